"""A control group per jail: the jail's memory (its tmpfs included: tmpfs pages are charged to the
writer's group), its number of processes and its CPU are limited as a whole, and every process of the
jail is killed when its run ends, whatever it did to detach itself (fork, setsid, double fork).

CPU: a quota of `cpus` cores for the whole jail, however many processes, sessions or threads it
makes, and the scheduler's fair share between groups, so that jails that run at once share the
cores as jails, not as processes (16 busy processes of one jail no longer starve another's one). The
group's CPU time (`cpu_seconds`) is what the run's time limit counts (`dare_core.rewards.sandbox.jail_run`).

cgroup v2 where this process may make child groups with the memory and pids controllers (and cpu,
where delegated), else cgroup v1 (one group under this process's own group in each of the memory,
pids, cpu and cpuacct hierarchies; cpu and cpuacct where mounted and writable). Where neither is
possible (no root, nothing delegated), `JailGroup.create` returns None and the jail keeps the
per-process rlimits only, which one log line says.

bubblewrap starts inside the group: a shell writes itself into the group's `cgroup.procs` and then
executes bubblewrap, so no jailed process ever exists outside it (no race with a pid written later).
"""
from __future__ import annotations

import itertools
import logging
import os
import shlex
import shutil
import signal
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)
_PREFIX = "dare-jail-"
_COUNTER = itertools.count()
_LOCK = threading.Lock()
# {"v2": path} | {"memory": path, "pids": path[, "cpu": path, "cpuacct": path]} | {} (none usable)
_LAYOUT: Optional[dict] = None
_V1 = ("memory", "pids", "cpu", "cpuacct")


def _own_groups() -> dict:
    """This process's group per hierarchy: {"": v2 path, "memory": ..., "pids": ...}."""
    groups = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                groups[name] = path
    return groups


def _mounts() -> dict:
    """Mount point (and the mount's root) of each cgroup hierarchy: {"": ..., "memory": ..., ...}."""
    found = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            root, point = fields[3], fields[4].replace("\\040", " ")
            if fstype == "cgroup2":
                found.setdefault("", (point, root))
            elif fstype == "cgroup":
                for name in _V1:
                    if name in options:
                        found.setdefault(name, (point, root))
    return found


def _directory(mounts: dict, groups: dict, name: str) -> Optional[str]:
    if name not in mounts or name not in groups:
        return None
    point, root = mounts[name]
    path = groups[name]
    if root != "/" and (path + "/").startswith(root + "/"):
        path = path[len(root):]
    return os.path.join(point, path.lstrip("/"))


def _writable(path: Optional[str]) -> bool:
    return bool(path) and os.path.isdir(path) and os.access(path, os.W_OK)


def _detect() -> dict:
    try:
        mounts, groups = _mounts(), _own_groups()
    except (OSError, ValueError, IndexError):
        return {}
    v2 = _directory(mounts, groups, "")
    if _writable(v2):
        try:
            with open(os.path.join(v2, "cgroup.controllers")) as f:
                available = set(f.read().split())
            if {"memory", "pids"} <= available:
                # fails (EBUSY) where this group itself holds processes and is not the root: then v2
                # cannot give children these controllers and v1 (if mounted) is tried instead
                with open(os.path.join(v2, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory +pids")
                if "cpu" in available:
                    try:  # optional: without it, jails keep wall-clock time limits
                        with open(os.path.join(v2, "cgroup.subtree_control"), "w") as f:
                            f.write("+cpu")
                    except OSError:
                        pass
                return {"v2": v2}
        except OSError:
            pass
    found = {name: _directory(mounts, groups, name) for name in _V1}
    if _writable(found["memory"]) and _writable(found["pids"]):
        return {name: path for name, path in found.items() if _writable(path)}
    return {}


def _remove_stale(layout: dict) -> None:
    """Groups of trainers that died without cleaning up (SIGKILL). `--die-with-parent` kills their
    jails, except a bubblewrap child still in its set-up when its parent died, which then waits
    forever for a signal from it: killed here, with anything else left in those groups."""
    for parent in sorted(set(layout.values())):  # cpu and cpuacct may share one hierarchy
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            owner = name[len(_PREFIX):].split("-", 1)[0]
            # a live owner pid (even a recycled one) leaves the group alone
            if name.startswith(_PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                JailGroup([os.path.join(parent, name)], "v2" in layout).remove(timeout=1.0)


def _layout() -> dict:
    global _LAYOUT
    with _LOCK:
        if _LAYOUT is None:
            _LAYOUT = _detect()
            _remove_stale(_LAYOUT)
            if not _LAYOUT:
                log.warning("code sandbox: no cgroup can be made here (not root, nothing delegated); jails "
                            "keep per-process rlimits only: no memory/process limit for a jail as a whole")
        return _LAYOUT


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _set_quota(group: str, cpus: float, v2: bool) -> Optional[float]:
    """Limit the group to `cpus` cores (its quota per period); None where the kernel refuses (v1
    refuses a quota above the parent group's own, which then bounds the jail anyway)."""
    try:
        if v2:
            period = int(_read(os.path.join(group, "cpu.max")).split()[1])
            _write(os.path.join(group, "cpu.max"), f"{max(1000, int(cpus * period))} {period}")
        else:
            period = int(_read(os.path.join(group, "cpu.cfs_period_us")))
            _write(os.path.join(group, "cpu.cfs_quota_us"), str(max(1000, int(cpus * period))))
    except (OSError, ValueError, IndexError) as exc:
        log.debug("code sandbox: no CPU quota for %s: %s", group, exc)
        return None
    return cpus


class JailGroup:
    """One jail's group(s): limits set, bubblewrap started inside, everything killed and removed after."""

    def __init__(self, directories: list[str], v2: bool, usage: Optional[str] = None, cpus: Optional[float] = None):
        self.directories, self.v2 = directories, v2
        self.usage = usage  # the file that counts the group's CPU time, where one does
        self.cpus = cpus  # the quota set, in cores (None: no quota)

    @classmethod
    def create(cls, memory_bytes: int, processes: int, cpus: Optional[float] = None) -> Optional["JailGroup"]:
        """A group for one jail: `memory_bytes` of memory, `processes` processes (the kernel's tasks: threads count) and (where the cpu controller
        is there) `cpus` cores; None where no group can be made."""
        layout = _layout()
        if not layout:
            return None
        name = f"{_PREFIX}{os.getpid()}-{next(_COUNTER)}"
        made: list[str] = []

        def make(parent: str) -> str:
            path = os.path.join(parent, name)
            if path not in made:  # co-mounted v1 controllers (cpu,cpuacct) share one directory
                os.mkdir(path)
                made.append(path)
            return path

        usage, quota = None, None
        try:
            if "v2" in layout:
                group = make(layout["v2"])
                _write(os.path.join(group, "memory.max"), str(memory_bytes))
                for optional, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    if os.path.exists(os.path.join(group, optional)):
                        _write(os.path.join(group, optional), value)
                _write(os.path.join(group, "pids.max"), str(processes))
                usage = os.path.join(group, "cpu.stat")  # usage_usec, kept by every v2 group
                if cpus and os.path.exists(os.path.join(group, "cpu.max")):
                    quota = _set_quota(group, cpus, v2=True)
            else:
                group = make(layout["memory"])
                _write(os.path.join(group, "memory.limit_in_bytes"), str(memory_bytes))
                try:  # with swap accounting: no swapping past the limit either
                    _write(os.path.join(group, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                except OSError:
                    pass
                _write(os.path.join(make(layout["pids"]), "pids.max"), str(processes))
                if "cpu" in layout:  # a group of its own is what shares the cores fairly between jails
                    group = make(layout["cpu"])
                    quota = _set_quota(group, cpus, v2=False) if cpus else None
                if "cpuacct" in layout:
                    usage = os.path.join(make(layout["cpuacct"]), "cpuacct.usage")
        except OSError as exc:
            log.warning("code sandbox: cannot make the jail's cgroup (%s); per-process rlimits only", exc)
            for path in reversed(made):
                try:
                    os.rmdir(path)
                except OSError:
                    pass
            return None
        return cls(made, "v2" in layout, usage, quota)

    def cpu_seconds(self) -> Optional[float]:
        """CPU time that the group's processes have used, or None where it is not counted."""
        if self.usage is None:
            return None
        try:
            text = _read(self.usage)
            if self.v2:
                return int(text.split("usage_usec", 1)[1].split()[0]) / 1e6
            return int(text) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv`, started inside the group: the shell moves itself there, then executes argv."""
        sh = shutil.which("sh", path="/bin:/usr/bin") or "/bin/sh"
        moves = " && ".join(f"echo 0 > {shlex.quote(os.path.join(d, 'cgroup.procs'))}" for d in self.directories)
        return [sh, "-c", f'{moves} && exec "$@"', "sh", *argv]

    def pids(self) -> list[int]:
        found = set()
        for directory in self.directories:
            try:
                with open(os.path.join(directory, "cgroup.procs")) as f:
                    found.update(int(p) for p in f.read().split())
            except (OSError, ValueError):
                pass
        return sorted(found)

    def populated(self) -> bool:
        """Whether a task of the group has not finished exiting. `cgroup.procs` already hides a
        process once it starts to exit, while it may still be tearing down its memory."""
        for directory in self.directories:
            try:
                if self.v2:
                    with open(os.path.join(directory, "cgroup.events")) as f:
                        if "populated 1" in f.read():
                            return True
                else:
                    with open(os.path.join(directory, "tasks")) as f:
                        if f.read().strip():
                            return True
            except OSError:
                pass
        return False

    def kill_all(self, timeout: float = 5.0, spare: Optional[int] = None) -> bool:
        """SIGKILL every process of the group (but `spare`) until none is left; True when it is empty.
        Sparing bubblewrap lets it reap its PID namespace's init, which the kernel lets exit only once
        every process of the namespace is gone: bubblewrap's exit then means the jail is gone."""
        if spare is None and self.v2 and os.path.exists(os.path.join(self.directories[0], "cgroup.kill")):
            try:
                _write(os.path.join(self.directories[0], "cgroup.kill"), "1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while True:
            pids = [pid for pid in self.pids() if pid != spare]
            if not pids and (spare is not None or not self.populated()):
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                try:
                    handle = os.pidfd_open(pid)  # pins the process: no pid reuse between check and kill
                except OSError:
                    continue
                try:
                    # still a member: a recycled pid cannot have joined the group (only jail forks do)
                    if pid in self.pids():
                        signal.pidfd_send_signal(handle, signal.SIGKILL)
                except OSError:
                    pass
                finally:
                    os.close(handle)
            time.sleep(0.005)

    def remove(self, timeout: float = 2.0) -> None:
        self.kill_all(timeout)
        for directory in self.directories:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY while the last processes are still being torn down
                    if time.monotonic() > deadline:
                        log.warning("code sandbox: cannot remove cgroup %s: %s", directory, exc)
                        break
                    time.sleep(0.01)
