"""launch.threads: torch's CPU thread count per worker (dare_core/process/threads.py)."""
import subprocess
import sys
import textwrap

import pytest

from dare_core.config import ConfigError, load_config
from dare_core.process import threads
from dare_core.process.threads import (REASON_VAR, Machine, auto_threads, busy_cpus, cgroup_cpus, launcher_env, physical_cores,
                                        resolve_threads)
from pipeline_helpers import worker_env


def cpuinfo(cores: int, threads_per_core: int) -> str:
    """/proc/cpuinfo of one socket whose hyperthreads are numbered core-major, as Linux lists them."""
    blocks = []
    for t in range(threads_per_core):
        for c in range(cores):
            blocks.append(f"processor\t: {t * cores + c}\nphysical id\t: 0\ncore id\t\t: {c}\nsiblings\t: {cores * threads_per_core}\n")
    return "\n".join(blocks)


def machine(cpus, info=None, cpu_max=None, busy=None) -> Machine:
    return Machine(frozenset(cpus), info, cpu_max, busy)


def test_physical_cores_count_distinct_cores_of_the_allowed_cpus():
    info = cpuinfo(4, 2)  # cpus 0-3 and 4-7 are the two threads of cores 0-3
    assert physical_cores(range(8), info) == 4
    assert physical_cores({0, 4}, info) == 1  # both threads of one core
    assert physical_cores({0, 1}, info) == 2
    assert physical_cores(range(8), "processor\t: 0\nprocessor\t: 1\n") is None  # no core ids: unknown
    assert physical_cores({0, 9}, info) is None  # a cpu the listing lacks: unknown


def test_cgroup_quota_in_whole_cpus():
    assert cgroup_cpus("max 100000\n") is None and cgroup_cpus(None) is None and cgroup_cpus("junk") is None
    assert cgroup_cpus("200000 100000\n") == 2
    assert cgroup_cpus("150000 100000") == 2  # a fractional quota rounds up
    assert cgroup_cpus("10000 100000") == 1


def test_auto_is_physical_cores_under_quota_per_local_rank():
    info = cpuinfo(8, 2)
    assert auto_threads(machine(range(16), info), 1).count == 8
    choice = auto_threads(machine(range(16), info), 2)
    assert (choice.count, choice.reason) == (4, "8 physical cores / 2 local ranks")
    assert auto_threads(machine(range(4), info), 1).count == 4  # affinity: cpus 0-3 are four distinct cores
    choice = auto_threads(machine(range(16), info, "300000 100000"), 1)
    assert (choice.count, choice.reason) == (3, "3 CPUs of cgroup quota / 1 local rank")
    assert auto_threads(machine(range(16), info, "max 100000"), 1).count == 8
    choice = auto_threads(machine(range(6)), 1)  # topology unknown: logical CPUs
    assert (choice.count, choice.reason) == (6, "6 CPUs / 1 local rank")
    assert auto_threads(machine(range(2), cpuinfo(2, 1)), 8).count == 1  # more ranks than cores: still one each


def test_the_load_sets_the_wait_policy_never_the_count():
    """The count follows the machine, so the same params give the same numbers on a busy machine;
    cores other processes keep busy make idle threads sleep (PASSIVE) instead of spinning."""
    info = cpuinfo(2, 1)
    choice = auto_threads(machine(range(2), info, busy=1.0), 1)  # the shared 2-core machine
    assert (choice.count, choice.passive) == (2, True)
    assert choice.reason == "2 physical cores / 1 local rank; 1 busy with other work: OMP_WAIT_POLICY=PASSIVE"
    assert auto_threads(machine(range(2), info, busy=3.7), 1).count == 2  # more busy than there are
    big = cpuinfo(16, 2)
    assert auto_threads(machine(range(32), big, busy=6.2), 2).count == 8
    # a core counts as taken from half its time on; a little background work leaves the policy alone
    assert not auto_threads(machine(range(32), big, busy=0.4), 1).passive
    assert auto_threads(machine(range(32), big, busy=0.5), 1).passive
    # one thread a rank: the wait policy does nothing, so none is chosen
    assert not auto_threads(machine(range(2), info, busy=1.0), 2).passive
    # the quota caps the count
    choice = auto_threads(machine(range(32), big, "300000 100000", busy=12), 1)
    assert (choice.count, choice.reason.split(";")[0]) == (3, "3 CPUs of cgroup quota / 1 local rank")
    # the launcher exports the policy, unless the user chose one
    env = launcher_env("auto", 1, {"PATH": "/bin"}, machine(range(2), info, busy=1.0))
    assert (env["OMP_NUM_THREADS"], env["OMP_WAIT_POLICY"]) == ("2", "PASSIVE")
    env = launcher_env("auto", 1, {"OMP_WAIT_POLICY": "ACTIVE"}, machine(range(2), info, busy=1.0))
    assert (env["OMP_NUM_THREADS"], env["OMP_WAIT_POLICY"]) == ("2", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in launcher_env("auto", 1, {}, machine(range(2), info, busy=0.0))


def test_an_idle_or_unmeasured_machine_keeps_every_core():
    info = cpuinfo(8, 2)
    for busy in (None, 0.0, 0.2):
        choice = auto_threads(machine(range(16), info, busy=busy), 2)
        assert (choice.count, choice.reason, choice.passive) == (4, "8 physical cores / 2 local ranks", False)


def stat(*cpus) -> str:
    """/proc/stat with one line per CPU of (user, idle) ticks, the rest zero, after the all-CPU line."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    lines += [f"cpu{i} {user} 0 0 {idle} 0 0 0 0 0 0" for i, (user, idle) in enumerate(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "", "ctxt 99"]) + "\n"


def test_busy_cpus_sum_each_cpus_busy_share():
    before = stat((100, 100), (100, 100), (100, 100))
    after = stat((110, 100), (105, 105), (100, 110))  # cpu0 busy, cpu1 half, cpu2 idle
    assert busy_cpus(before, after, {0, 1, 2}) == pytest.approx(1.5)
    assert busy_cpus(before, after, {1, 2}) == pytest.approx(0.5)  # only the CPUs this process may use
    steal = "cpu0 100 0 0 100 0 0 0 0 0 0\n", "cpu0 100 0 0 105 0 0 0 5 0 0\n"  # a hypervisor took half
    assert busy_cpus(*steal, {0}) == pytest.approx(0.5)
    assert busy_cpus(before, after, {0, 3}) is None  # a CPU /proc/stat does not list: unknown
    assert busy_cpus(before, before, {0}) is None  # no tick passed
    assert busy_cpus("", "", {0}) is None


def test_the_machine_is_read_only_where_auto_decides(monkeypatch):
    def unread():
        raise AssertionError("read_machine called")

    monkeypatch.setattr(threads, "read_machine", unread)
    assert resolve_threads(3, {}).count == 3
    assert resolve_threads("auto", {"OMP_NUM_THREADS": "2"}).count == 2
    assert launcher_env("auto", 2, {"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "2"


def test_read_machine_measures_this_machine():
    m = threads.read_machine(busy_sample_s=0.05)
    assert m.cpus and (m.busy is None or 0 <= m.busy <= len(m.cpus))
    assert threads.read_machine(busy_sample_s=0).busy is None


def test_local_ranks_come_from_the_launchers_variables():
    m = machine(range(8), cpuinfo(8, 1))
    assert resolve_threads("auto", {}, m).count == 8
    assert resolve_threads("auto", {"LOCAL_WORLD_SIZE": "4"}, m).count == 2  # torchrun
    assert resolve_threads("auto", {"LOCAL_SIZE": "2"}, m).count == 4  # the deepspeed launcher


def test_omp_num_threads_wins_over_auto_and_an_int_wins_over_both():
    m = machine(range(8), cpuinfo(8, 1))
    env = {"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "2"}
    choice = resolve_threads("auto", env, m)
    assert (choice.count, choice.reason) == (3, "OMP_NUM_THREADS=3 in the environment")
    assert resolve_threads("auto", {"OMP_NUM_THREADS": "5,2"}, m).count == 5  # nested levels: the first
    assert resolve_threads("auto", {"OMP_NUM_THREADS": " "}, m).count == 8  # empty: unset
    # set by `dare stage` for its ranks: the log says why the launcher chose it
    assert resolve_threads("auto", {**env, REASON_VAR: "8 physical cores / 2 local ranks"}, m).reason == "8 physical cores / 2 local ranks"
    choice = resolve_threads(6, env, m)
    assert (choice.count, choice.reason) == (6, "launch.threads: 6")
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS='many'.*launch\.threads"):
        resolve_threads("auto", {"OMP_NUM_THREADS": "many"}, m)


def test_launcher_exports_each_ranks_share():
    m = machine(range(8), cpuinfo(8, 1))
    env = launcher_env("auto", 4, {"PATH": "/bin", REASON_VAR: "stale"}, m)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2" and env["PATH"] == "/bin"
    assert env[REASON_VAR] == "8 physical cores / 4 local ranks"
    user = launcher_env("auto", 4, {"OMP_NUM_THREADS": "1", REASON_VAR: "stale"}, m)
    assert user == {"OMP_NUM_THREADS": "1"}  # the user's count reaches the ranks as it is
    env = launcher_env(3, 4, {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, m)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"


def test_dare_stage_passes_the_counts_to_the_launcher(tmp_path, monkeypatch):
    from dare_core import cli

    params = tmp_path / "params.yaml"
    params.write_text("launch: {launcher: torchrun, nproc: 2, threads: 5}\n")
    seen = {}
    monkeypatch.setattr(cli, "_launch", lambda cmd, env, *_: seen.update(cmd=cmd, env=env) or 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cli.main(["stage", "sft", "--params", str(params)]) == 0
    assert "--nproc_per_node=2" in seen["cmd"] and seen["env"]["OMP_NUM_THREADS"] == "5"


def test_config_key(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("run: {seed: 0}\n")  # (an empty file is refused)
    assert load_config(params).launch.threads == "auto"
    assert load_config(params, ["launch.threads=4"]).launch.threads == 4
    for bad in ("launch.threads=0", "launch.threads=many"):
        with pytest.raises(ConfigError, match=r"launch\.threads"):
            load_config(params, [bad])


WORKER = textwrap.dedent("""
    import os, sys
    from dare_core.workers.common import run_worker  # (a worker module: before torch, as `-m dare_core.workers.sft`)
    wait = os.environ.get("OMP_WAIT_POLICY")
    import torch
    sys.exit(run_worker(lambda cfg: print("threads", torch.get_num_threads(), wait), sys.argv[1:], "probe"))
""")


@pytest.mark.parametrize("extra_env, args, expected, reason", [
    ({}, ["-S", "launch.threads=3"], "3 None", "launch.threads: 3"),
    ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}, [], "2 PASSIVE", "OMP_NUM_THREADS=2 in the environment"),
])
def test_a_worker_sets_torchs_thread_count_and_keeps_the_wait_policy(tmp_path, extra_env, args, expected, reason):
    params = tmp_path / "params.yaml"
    params.write_text("run: {seed: 0}\n")  # (an empty file is refused)
    env = {k: v for k, v in worker_env().items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", REASON_VAR)}
    r = subprocess.run([sys.executable, "-c", WORKER, "--params", str(params), *args], env={**env, **extra_env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"threads {expected}" in r.stdout
    count = expected.split()[0]
    assert r.stderr.count("torch threads:") == 1 and f"torch threads: {count} ({reason})" in r.stderr
