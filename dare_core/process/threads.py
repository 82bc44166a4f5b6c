"""How many CPU threads torch uses in a worker (`launch.threads`).

torch defaults to one intra-op thread per logical CPU in every process, so several ranks on one
machine (or a machine shared with other jobs) oversubscribe the cores and spin-wait on each other:
a user measured SFT at 10 samples/s that way against 71-92/s with one thread per rank.

Precedence: an int in `launch.threads` > `OMP_NUM_THREADS` in the environment (the user's choice)
> auto = the physical cores this process may use (CPU affinity, cgroup CPU quota) / local ranks.
auto reads the machine, never its load: the thread count changes how torch splits its sums, so a
count that followed the load made the same params and seed print different tables on a busy
machine than on an idle one. What the load decides is OpenMP's wait policy, which changes speed
only: when other processes keep cores busy as the stage starts, the launcher exports
OMP_WAIT_POLICY=PASSIVE (unless the user set one), so a thread whose core another job holds
sleeps instead of spinning while its peers wait for it (bench/results/threads.md: spinning threads
that share cores with other jobs ran up to 3 times slower; on an idle machine PASSIVE cost up
to a third of the speed, so it is not the default). The decision is applied at the start of every worker
(`configure_threads`) and logged once the stage's checks have passed (`log_threads`): a failing
check leaves only its error line on stderr.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping, Optional, Union

log = logging.getLogger(__name__)

# set by `dare stage` next to the OMP_NUM_THREADS it exports to its ranks, so that each rank's log
# line says why the count was chosen rather than only where it came from
REASON_VAR = "DARE_THREADS_REASON"
# how long auto watches the CPUs for other processes' work: 10 scheduler ticks per CPU at the
# usual 100 Hz, enough to tell a busy core from an idle one, short beside a stage's start
BUSY_SAMPLE_S = 0.1


@dataclass(frozen=True)
class Machine:
    """What auto needs to know about the CPUs, as read from the system (`read_machine`)."""

    cpus: frozenset  # logical CPU ids this process may run on
    cpuinfo: Optional[str] = None  # /proc/cpuinfo text, for the core each logical CPU belongs to
    cpu_max: Optional[str] = None  # cgroup v2 cpu.max text: "<quota> <period>" or "max <period>"
    # CPUs of `cpus` that other processes kept busy while it was read (`busy_cpus`); None: unknown
    busy: Optional[float] = None


@dataclass(frozen=True)
class ThreadChoice:
    count: int
    reason: str
    # other processes kept cores busy: the launcher makes idle threads sleep (module docstring)
    passive: bool = False


def physical_cores(cpus: Collection[int], cpuinfo: str) -> Optional[int]:
    """Distinct (socket, core) pairs among `cpus`, or None where /proc/cpuinfo does not say (some
    VMs and ARM machines omit core ids): hyperthreads share a core's arithmetic units, so more
    threads than cores only adds contention."""
    cores, seen = set(), set()
    for block in cpuinfo.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" not in fields or not fields["processor"].isdigit():
            continue
        cpu = int(fields["processor"])
        if cpu not in cpus:
            continue
        if "core id" not in fields:
            return None
        seen.add(cpu)
        cores.add((fields.get("physical id", "0"), fields["core id"]))
    # a CPU missing from the listing leaves the topology unknown
    return len(cores) if cores and seen == set(cpus) else None


def cgroup_cpus(cpu_max: Optional[str]) -> Optional[int]:
    """The CPU quota of a cgroup v2 `cpu.max` text in whole CPUs, or None when unlimited/unreadable.
    A fractional quota rounds up, as the JVM and .NET do: 1.5 CPUs still run two threads at once."""
    parts = (cpu_max or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def local_ranks(environ: Mapping[str, str]) -> int:
    """Processes of this job on this machine: torchrun sets LOCAL_WORLD_SIZE, the deepspeed
    launcher LOCAL_SIZE; a process started alone is one."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = environ.get(var, "").strip()
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return 1


def busy_cpus(stat_before: str, stat_after: str, cpus: Collection[int]) -> Optional[float]:
    """How many of `cpus` were busy between two readings of /proc/stat: the sum of each CPU's busy
    share of its ticks (time stolen by a hypervisor counts as busy: the CPU was not ours to use).
    None where a CPU's line is missing or no tick passed."""
    def ticks(text: str) -> dict:  # cpu id -> (busy ticks, all ticks)
        out = {}
        for line in text.splitlines():
            name, *fields = line.split() or [""]
            values = fields[:8]  # user nice system idle iowait irq softirq steal (guest is inside user)
            if name[:3] == "cpu" and name[3:].isdigit() and len(values) >= 4 and all(v.isdigit() for v in values):
                counts = [int(v) for v in values]
                out[int(name[3:])] = (sum(counts) - sum(counts[3:5]), sum(counts))
        return out

    before, after = ticks(stat_before), ticks(stat_after)
    busy = 0.0
    for cpu in cpus:
        if cpu not in before or cpu not in after:
            return None
        spent, total = after[cpu][0] - before[cpu][0], after[cpu][1] - before[cpu][1]
        if total <= 0:
            return None
        busy += spent / total
    return busy


def auto_threads(machine: Machine, ranks: int) -> ThreadChoice:
    """Physical cores available to this process (else logical CPUs), capped by the cgroup quota,
    shared among `ranks` local processes; at least 1. The load never changes the count (results
    follow it); cores that other processes keep busy make the choice `passive` where a rank runs
    more than one thread (with one, the wait policy does nothing)."""
    logical = max(1, len(machine.cpus))
    physical = physical_cores(machine.cpus, machine.cpuinfo) if machine.cpuinfo else None
    cores, what = (physical, "physical cores") if physical else (logical, "CPUs")
    free, label = cores, f"{cores} {what}"
    quota = cgroup_cpus(machine.cpu_max)
    if quota is not None and quota < free:
        free, label = quota, f"{quota} CPUs of cgroup quota"
    ranks = max(1, ranks)
    count = max(1, free // ranks)
    reason = f"{label} / {ranks} local rank{'s' if ranks != 1 else ''}"
    # a CPU counts as taken when another process used more than half of it
    busy = math.floor(machine.busy + 0.5) if machine.busy else 0
    passive = busy > 0 and count > 1
    if passive:
        reason += f"; {busy} busy with other work: OMP_WAIT_POLICY=PASSIVE"
    return ThreadChoice(count, reason, passive)


def omp_threads(environ: Mapping[str, str]) -> Optional[int]:
    """OMP_NUM_THREADS as a count (its first level where it lists nested ones), None when unset."""
    raw = environ.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS={raw!r} in the environment is not a positive integer; "
                         "unset it or set launch.threads")
    return int(first)


def resolve_threads(setting: Union[str, int], environ: Mapping[str, str], machine: Optional[Machine] = None) -> ThreadChoice:
    """The thread count for `launch.threads` = `setting`, by the module docstring's precedence.
    `machine` is read (`read_machine`, a tenth of a second) only where auto decides."""
    if not isinstance(setting, str):
        return ThreadChoice(int(setting), f"launch.threads: {setting}")
    omp = omp_threads(environ)
    if omp is not None:
        return ThreadChoice(omp, environ.get(REASON_VAR) or f"OMP_NUM_THREADS={omp} in the environment")
    return auto_threads(machine or read_machine(), local_ranks(environ))


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cgroup_v1_cpu_max() -> Optional[str]:
    # cgroup v1 spells cpu.max as two files; -1 is its "no quota"
    quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return f"{'max' if quota.strip() == '-1' else quota.strip()} {period.strip()}"


def _measure_busy(cpus: Collection[int], seconds: float) -> Optional[float]:
    """CPUs of `cpus` busy with other processes' work over the next `seconds`: /proc/stat per CPU
    (so a container counts the host CPUs it may use, not the whole host), less this process's own
    CPU time. The caller sleeps meanwhile, so a launcher measures the machine before its ranks start."""
    before, own_before, started = _read("/proc/stat"), os.times(), time.monotonic()
    if before is None:
        return None
    time.sleep(seconds)
    after, own_after, elapsed = _read("/proc/stat"), os.times(), time.monotonic() - started
    busy = busy_cpus(before, after or "", cpus)
    if busy is None:
        return None
    own = (own_after.user - own_before.user) + (own_after.system - own_before.system)
    return max(0.0, busy - own / elapsed)


def read_machine(busy_sample_s: float = BUSY_SAMPLE_S) -> Machine:
    """This process's CPUs as the system reports them, and how busy others keep them right now."""
    try:
        cpus = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = frozenset(range(os.cpu_count() or 1))
    return Machine(cpus, _read("/proc/cpuinfo"), _read("/sys/fs/cgroup/cpu.max") or _cgroup_v1_cpu_max(),
                   _measure_busy(cpus, busy_sample_s) if busy_sample_s > 0 else None)


_applied: Optional[ThreadChoice] = None
_logged = False


def configure_threads(setting: Union[str, int]) -> ThreadChoice:
    """Set torch's intra-op (and, while still allowed, inter-op) thread count for this process."""
    import torch

    global _applied, _logged
    choice = resolve_threads(setting, os.environ)
    torch.set_num_threads(choice.count)
    try:
        torch.set_num_interop_threads(choice.count)
    except RuntimeError:
        pass  # settable once, before any inter-op work; the default pool is then kept
    _applied, _logged = choice, False
    return choice


def log_threads() -> None:
    """Log the applied count once per worker, from its first local rank only (every rank has the
    same count). Called where a stage's checks have passed, so an error stays the only line."""
    global _logged
    if _applied is None or _logged:
        return
    _logged = True
    if os.environ.get("LOCAL_RANK", "0") == "0":
        log.info("torch threads: %d (%s)", _applied.count, _applied.reason)


def launcher_env(setting: Union[str, int], nproc: int, environ: Mapping[str, str],
                 machine: Optional[Machine] = None) -> dict:
    """`environ` plus the OMP/MKL thread counts for the `nproc` ranks a launcher starts on this
    machine. Exported before launching because torchrun
    otherwise sets OMP_NUM_THREADS=1 for several ranks, which each rank would then take for the
    user's choice."""
    env = dict(environ)
    env.pop(REASON_VAR, None)  # a stale reason from an enclosing launch would misreport this one
    if isinstance(setting, str) and omp_threads(env) is not None:
        return env  # the user's OMP_NUM_THREADS reaches every rank as it is
    choice = resolve_threads(setting, {**env, "LOCAL_WORLD_SIZE": str(nproc)}, machine)
    env["OMP_NUM_THREADS"] = str(choice.count)
    if choice.passive:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if isinstance(setting, str):
        env.setdefault("MKL_NUM_THREADS", str(choice.count))
    else:
        env["MKL_NUM_THREADS"] = str(choice.count)
    env[REASON_VAR] = choice.reason
    return env
