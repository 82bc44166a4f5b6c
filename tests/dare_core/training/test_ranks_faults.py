"""Several ranks on the CPU (gloo), under the real launchers: a rank that dies ends the whole job
with an error naming it, a rank that hangs ends it after launch.timeout_s, a killed 2-rank run
resumes to the weights of an uninterrupted one, a ZeRO-3 checkpoint converts to the folder a
1-rank run gives; and the launch commands for several nodes.

Every subprocess has a timeout, so that a hang fails the test instead of freezing it."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from dare_core.cli import launch_command
from dare_core.config import ConfigError, LaunchConfig, load_config
from dare_core.data.prepare import prepare
from ports import unused_port
from pipeline_helpers import assert_no_native_noise, dare, tiny_params, worker_env, write_params

RUN_S = 240  # any one stage run here takes seconds; past this it hangs
# the runs here find the launchers without the venv on PATH (`.venv/bin/dare` not activated)
ENV = worker_env(venv_on_path=False)


def _project(root: Path, **over) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    params = write_params(root / "params.yaml", tiny_params(root, **over))
    prepare(load_config(params))
    return params


def _two_ranks(launcher: str, zero: int = 0) -> dict:
    return {"launch__launcher": launcher, "launch__nproc": 2, "launch__zero_stage": zero, "launch__threads": 1,
            **({"launch__master_port": unused_port()} if launcher == "deepspeed" else {})}


def _stage(name: str, params: Path, *extra: str) -> subprocess.CompletedProcess:
    r = subprocess.run(dare("stage", name, "--params", str(params), *extra), env=ENV, capture_output=True,
                       text=True, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_no_native_noise(r.stderr)
    return r


def _weights(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _workers(root: psutil.Process, module: str = "dare_core.workers.sft") -> list[psutil.Process]:
    """The stage workers under `root` (not their guards, whose command line names the module too)."""
    out = []
    for p in root.children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if any(a == "-m" and b == module for a, b in zip(cmd, cmd[1:])):
            out.append(p)
    return out


def _rank_of(p: psutil.Process) -> str:
    try:
        return p.environ().get("RANK", "")
    except psutil.Error:
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_all(proc: subprocess.Popen, seen: list[psutil.Process]) -> None:
    """Whatever a failed test leaves behind: the launcher's group and every worker it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in seen:
        try:
            p.kill()
        except psutil.Error:
            pass


def _faulty_run(tmp_path: Path, launcher: str, fault: signal.Signals, **over):
    """A 2-rank SFT run that would train for minutes; once its first metrics are logged, rank 1's
    worker gets `fault`. Returns (exit code, stderr, seconds from the fault to the end, workers)."""
    params = _project(tmp_path, sft__max_steps=100_000, sft__save_every=100_000, sft__log_every=2, **_two_ranks(launcher), **over)
    metrics = tmp_path / "runs" / "t" / "sft" / "metrics.jsonl"
    proc = subprocess.Popen(dare("stage", "sft", "--params", str(params)), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: list[psutil.Process] = []
    try:
        deadline = time.time() + RUN_S
        while time.time() < deadline and proc.poll() is None and not (metrics.exists() and metrics.stat().st_size):
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        seen = _workers(psutil.Process(proc.pid))
        victim = next(p for p in seen if _rank_of(p) == "1")
        victim.send_signal(fault)
        t0 = time.time()
        _, err = proc.communicate(timeout=RUN_S)
        elapsed = time.time() - t0
        psutil.wait_procs(seen, timeout=30)
        left = [p.pid for p in seen if _alive(p)]
        return proc.returncode, err, elapsed, victim.pid, left
    finally:
        _stop_all(proc, seen)


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_dead_rank_ends_the_job_with_an_error_naming_it(tmp_path, launcher):
    code, err, elapsed, pid, left = _faulty_run(tmp_path, launcher, signal.SIGKILL)
    assert code != 0
    # the launcher stops the other rank at once (gloo also reports the closed connection to it)
    assert elapsed < 60, elapsed
    assert f"error: rank 1: the worker (pid {pid}) was killed by SIGKILL" in err, err[-3000:]
    assert not left, f"workers still running: {left}"
    assert not (tmp_path / "runs" / "t" / "sft" / "model").exists()


def test_a_hung_rank_ends_the_job_after_the_timeout(tmp_path):
    # rank 1 stops (SIGSTOP: alive, holding its connections, never answering): rank 0 waits
    # launch.timeout_s in its next collective, fails, and the launcher ends rank 1
    code, err, elapsed, _, left = _faulty_run(tmp_path, "torchrun", signal.SIGSTOP, launch__timeout_s=10)
    assert code != 0
    assert 10 <= elapsed < 60, elapsed
    assert "error: rank 0: lost contact with the other ranks" in err and "Timed out" in err, err[-3000:]
    # the line names the collective that waited (the innermost torch.distributed call)
    assert re.search(r"lost contact with the other ranks: \w+ timed out after 10 s \(launch.timeout_s\)", err), err[-3000:]
    assert not left, f"workers still running: {left}"


def test_killed_two_rank_sft_resumes_to_identical_weights(tmp_path):
    # warmup ends between the first checkpoint (where the run is killed) and the last step, so the
    # resumed run restores a schedule in warmup and crosses into its decay
    over = {"sft__max_steps": 60, "sft__save_every": 20, "sft__log_every": 10, "sft__optim__warmup_steps": 30,
            **_two_ranks("torchrun")}
    a, b = tmp_path / "a", tmp_path / "b"
    pa, pb = _project(a, **over), _project(b, **over)
    _stage("sft", pa)

    ckpts = b / "runs" / "t" / "sft" / "checkpoints"
    proc = subprocess.Popen(dare("stage", "sft", "--params", str(pb)), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    seen: list[psutil.Process] = []
    try:
        deadline = time.time() + RUN_S
        while not (ckpts / "latest").exists() and time.time() < deadline and proc.poll() is None:
            seen = seen or _workers(psutil.Process(proc.pid))
            time.sleep(0.01)
        # the whole job at once: `dare`, the launcher and (their parent gone) both ranks
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=RUN_S)
        psutil.wait_procs(seen, timeout=30)
        assert not [p.pid for p in seen if _alive(p)], "a rank outlived its launcher"
    finally:
        _stop_all(proc, seen)
    killed_at = int((ckpts / "latest").read_text().strip()[len("step"):])
    assert 0 < killed_at < 60, "the run must be killed in the middle"
    assert not (b / "runs" / "t" / "sft" / "model").exists()

    resumed = _stage("sft", pb)
    assert f"resuming SFT from step{killed_at:08d}" in resumed.stderr
    # the same ranks add the same numbers in the same order, and a checkpoint restores the weights,
    # Adam's moments, the schedule and the step exactly: the resumed run is the uninterrupted one, bit for bit
    wa, wb = _weights(a / "runs" / "t" / "sft" / "model"), _weights(b / "runs" / "t" / "sft" / "model")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k

    def curve(root: Path) -> list:
        rows = [json.loads(line) for line in (root / "runs" / "t" / "sft" / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if "loss" in r]

    # one writer (rank 0): every step once, in order, and the same losses
    assert curve(b) == curve(a) and [s for s, _ in curve(a)] == list(range(10, 61, 10))
    kept = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    assert kept == ["step00000040", "step00000060"]  # complete checkpoints only, no .tmp-*


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero3_checkpoint_converts_to_the_one_rank_folder(tmp_path, dtype):
    """`dare stage convert` on a 2-rank ZeRO-3 checkpoint (each rank holds half the fp32 master
    weights) writes the folder a 1-rank ZeRO-0 run of the same config gives: same files, config,
    tensor names, shapes and dtypes (bf16 stays bf16), and the same values up to the rounding of
    the gradient sums. The convert stage reads the RL stage's checkpoints; the SFT stage's, moved
    there, are the same format (CheckpointManager), and SFT on one rank with two micro-batches
    makes the same updates as two ranks with one each."""
    over = {"sft__max_steps": 4, "sft__save_every": 4, "sft__optim": {"lr": 3.0e-3, "warmup_steps": 0}, "model__dtype": dtype}
    one, two = tmp_path / "one", tmp_path / "two"
    p1 = _project(one, sft__grad_accum=2, **over)
    p2 = _project(two, **over, **_two_ranks("torchrun", zero=3))
    _stage("sft", p1)
    _stage("sft", p2)
    shards = sorted(p.name for p in (two / "runs" / "t" / "sft" / "checkpoints" / "step00000004").iterdir())
    assert any("zero_pp_rank_1_mp_rank_00_optim_states.pt" in n for n in shards) and "mp_rank_00_model_states.pt" not in shards
    for root, params in ((one, p1), (two, p2)):
        shutil.copytree(root / "runs" / "t" / "sft" / "checkpoints", root / "runs" / "t" / "rl" / "checkpoints")
        _stage("convert", params)

    f1, f2 = one / "models" / "t", two / "models" / "t"
    assert sorted(p.name for p in f1.iterdir()) == sorted(p.name for p in f2.iterdir())
    assert json.loads((f1 / "config.json").read_text()) == json.loads((f2 / "config.json").read_text())
    w1, w2 = _weights(f1), _weights(f2)
    # each run's convert gives exactly the weights it trained (its own export at the end of SFT)
    for root, w in ((one, w1), (two, w2)):
        trained = _weights(root / "runs" / "t" / "sft" / "model")
        assert trained.keys() == w.keys() and all(torch.equal(trained[k], w[k]) for k in w)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert w2[k].shape == w1[k].shape and w2[k].dtype == w1[k].dtype == getattr(torch, dtype), k
    diff = torch.cat([(w2[k].float() - w1[k].float()).abs().flatten() for k in w1])
    if dtype == "float32":
        # ZeRO-3 sums the two ranks' gradients by reduce-scatter, one rank accumulates them: another
        # order, other float32 roundings. Adam divides each coordinate's step by the size of its
        # gradient, so where a gradient is ~0 a rounding difference can move the weight by up to lr
        # per step (3e-3); almost everywhere the difference stays at rounding level. Measured: max
        # 2.7e-6, median 7e-10, 1 of 27296 above 1e-6. A lost or misplaced shard would be off by the
        # size of the weights (~0.07) over whole rows.
        assert diff.max() <= 1e-3 and (diff > 1e-6).float().mean() <= 1e-3, (diff.max(), (diff > 1e-6).sum())
    else:
        # bf16 trains differently at ZeRO 0 and ZeRO 1-3 (the runs, not the conversion): DeepSpeed's
        # ZeRO-0 bf16 wrapper (FP16_UnfusedOptimizer) steps Adam once on zero gradients when it
        # starts, so its bias correction runs one step ahead (first update 0.744 lr instead of lr;
        # ZeRO 1-3 take lr). The weights then differ by up to about lr per step (measured: max
        # 0.0126 after 4 steps of lr 3e-3, median 9e-4); a lost or misplaced shard would be off by
        # the weights' size (~0.07) over whole rows
        assert diff.max() <= 2 * 3e-3 * 4, diff.max()


# --------------------------------------------------------------------------- launch commands


def _cmd(**launch) -> list[str]:
    return launch_command("dare_core.workers.sft", LaunchConfig(**launch), ["--params", "p.yaml"])


def test_launch_commands_for_one_node():
    assert _cmd() == [sys.executable, "-m", "dare_core.workers.sft", "--params", "p.yaml"]
    assert _cmd(launcher="torchrun", nproc=4) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        "-m", "dare_core.workers.common", "dare_core.workers.sft", "--params", "p.yaml"]
    ds = _cmd(launcher="deepspeed", nproc=2)
    # DeepSpeed's runner run by this interpreter, not a `deepspeed` looked up on PATH; no hostfile:
    # this machine only, even where DeepSpeed's default /job/hostfile exists
    assert ds == [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={os.devnull}", "--num_gpus=2",
                  "--module", "dare_core.workers.common", "dare_core.workers.sft", "--params", "p.yaml"]
    assert _cmd(launcher="deepspeed", nproc=2, master_port=29600)[4] == "--master_port=29600"
    with pytest.raises(ConfigError, match="runs one process"):
        _cmd(nproc=2)


def test_launch_commands_for_several_nodes():
    ds = _cmd(launcher="deepspeed", nproc=8, hostfile="/shared/hostfile", master_addr="10.0.0.1", master_port=29600)
    assert ds[3:] == ["--hostfile=/shared/hostfile", "--master_addr=10.0.0.1", "--master_port=29600", "--num_gpus=8",
                      "--module", "dare_core.workers.common", "dare_core.workers.sft", "--params", "p.yaml"]
    tr = _cmd(launcher="torchrun", nproc=8, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    assert tr[3:] == ["--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500",
                      "--nproc_per_node=8", "-m", "dare_core.workers.common", "dare_core.workers.sft", "--params", "p.yaml"]
    assert "--standalone" not in tr


def test_the_ranks_environment():
    from dare_core.cli import launch_env

    env = launch_env(LaunchConfig(launcher="torchrun", nproc=2, threads=1), {"PATH": "/usr/bin"})
    # this interpreter's tools (ninja) found as in an activated venv
    assert env["PATH"] == f"{os.path.dirname(sys.executable)}{os.pathsep}/usr/bin"
    # a hung rank ends the job soon after launch.timeout_s, not after NCCL's wait for its debug dump
    assert env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "2500"
    mine = {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "60000"}
    assert launch_env(LaunchConfig(), mine)["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "60000"


def test_launch_commands_for_nodes_started_one_by_one(tmp_path):
    """The deepspeed launcher without ssh: each node's `dare stage` starts its own ranks, its
    node_rank checked against the hostfile's nodes."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the first node is the head\nnode-a slots=8\n\nnode-b slots=8\n")
    ds = _cmd(launcher="deepspeed", nproc=8, hostfile=str(hostfile), master_addr="10.0.0.1", no_ssh=True, node_rank=1)
    assert ds[3:7] == [f"--hostfile={hostfile}", "--no_ssh", "--node_rank=1", "--master_addr=10.0.0.1"]
    with pytest.raises(ConfigError, match="one of the 2 nodes of launch.hostfile"):
        _cmd(launcher="deepspeed", hostfile=str(hostfile), master_addr="10.0.0.1", no_ssh=True, node_rank=2)
    with pytest.raises(ConfigError, match="No such file"):
        _cmd(launcher="deepspeed", hostfile=str(tmp_path / "nope"), master_addr="10.0.0.1", no_ssh=True)


@pytest.mark.parametrize("settings, key", [
    (["launch.launcher=torchrun", "launch.nnodes=2"], "launch.master_addr"),
    (["launch.launcher=deepspeed", "launch.nnodes=2", "launch.master_addr=h"], "launch.nnodes"),
    (["launch.launcher=torchrun", "launch.hostfile=h"], "launch.hostfile"),
    (["launch.launcher=torchrun", "launch.nnodes=2", "launch.node_rank=2", "launch.master_addr=h"], "launch.node_rank"),
    (["launch.master_port=29600"], "launch.master_port"),
    (["launch.launcher=torchrun", "launch.no_ssh=true"], "launch.no_ssh"),
    (["launch.launcher=deepspeed", "launch.no_ssh=true", "launch.master_addr=h"], "launch.hostfile"),
    (["launch.launcher=deepspeed", "launch.no_ssh=true", "launch.hostfile=h"], "launch.master_addr"),
    (["launch.launcher=deepspeed", "launch.node_rank=1"], "launch.node_rank"),
    (["launch.timeout_s=0"], "launch.timeout_s"),
])
def test_bad_launch_settings_are_named(tmp_path, settings, key):
    params = tmp_path / "params.yaml"
    params.write_text("run: {seed: 0}\n")  # (an empty file is refused)
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(params, settings)


# --------------------------------------------------------------------------- error lines


def test_error_lines_name_the_rank(monkeypatch, capsys):
    from dare_core.workers.common import report_error, run_reporting_errors

    report_error(ValueError("bad row"))
    assert capsys.readouterr().err == "error: bad row\n"  # one process: as before
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    report_error(ValueError("bad row"))
    assert capsys.readouterr().err == "error: rank 1: bad row\n"

    def lost():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7879")

    assert run_reporting_errors(lost) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: rank 1: lost contact with the other ranks") and "Traceback" not in err

    def bug():
        raise KeyError("x")

    assert run_reporting_errors(bug) == 1  # a bug keeps its traceback, then the line naming the rank
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "error: rank 1: KeyError: 'x'"

    def refused():  # NCCL refusing a setting: one line, without blaming the other ranks
        raise torch.distributed.DistBackendError("NCCL error: invalid usage. Last error: Duplicate GPU detected")

    assert run_reporting_errors(refused) == 1
    assert capsys.readouterr().err == ("error: rank 1: the process group failed: DistBackendError: NCCL error: invalid "
                                       "usage. Last error: Duplicate GPU detected\n")


def test_every_group_waits_launch_timeout_s(tmp_path):
    """Groups made after the default one (DeepSpeed reduces gradients over its copy of the world
    group) would wait torch's default (gloo 30 min, NCCL 10 min) for a hung rank."""
    probe = ("import torch\n"
             "from deepspeed.utils import groups\n"
             "from dare_core.process.process_group import init_distributed, shutdown_distributed\n"
             "init_distributed()\n"
             "print(groups._clone_world_group()._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
             "shutdown_distributed(clean=True)\n")
    env = {**worker_env(), "DARE_DIST_TIMEOUT_S": "7", "MASTER_PORT": str(unused_port())}
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "7.0"
