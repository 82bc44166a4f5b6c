"""Running jails: one bubblewrap per jailed process, fed its job, its streams collected, its time
limit kept, and everything of it killed before the call returns (`dare_core.rewards.sandbox` says
what a run is; docs/sandbox.md why).

The time limit of a run is CPU time where every jail of the run has a cgroup that counts it: what
its jails spent together, so that a program waiting for a core (other jails, other work on the
machine) is not charged for the wait, while a program that sleeps or blocks still ends at the
wall-clock backstop (`SandboxLimits.backstop` times the limit). Without such a cgroup the limit is
wall clock, as before.
"""
from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from typing import Optional, Sequence

import dare_core.rewards.sandbox.seccomp as seccomp
from dare_core.rewards.sandbox._verdict import drain_pipe
from dare_core.rewards.sandbox.cgroup import JailGroup
from dare_core.rewards.sandbox.harness import modules_for
from dare_core.rewards.sandbox.jail import SandboxLimits, bwrap_path, jail_command, jail_memory_bytes, jail_processes, memfd, rlimits
from dare_core.rewards.sandbox.runtime import open_for_jail, runtime_image

READY = b"R"  # the start-up code's first byte on its result pipe
# Result-pipe caps. Whatever reaches the trainer through a pipe is bounded by what an honest start-up
# code writes: the tests' jail a short verdict, the candidate's jail of a test run only READY, and a
# stdin/stdout jail one entry per case whose output is already cut at `limits.output_bytes`
# (`_verdict.result_cap`). A jail writing more is stopped and scores 0 ("malformed").
RESULT_BYTES = 64 * 1024
# Jails starting at once: each holds one descriptor per file of the runtime image (~70) until its
# bubblewrap has started, which must stay well under the trainer's open-file limit
_STARTING = threading.BoundedSemaphore(4)


class Jail:
    """One jailed process: its job on stdin, its output, bubblewrap's info and (optionally) a result pipe."""

    def __init__(self, name: str, job: dict, limits: SandboxLimits, pass_fds: Sequence[int] = ()):
        self.name = name
        self.group: Optional[JailGroup] = None
        self.proc: Optional[subprocess.Popen] = None
        arch = seccomp.machine()  # SandboxUnavailable on an architecture the filter does not know
        info_r, info_w = os.pipe()
        result_r, result_w = os.pipe()
        self.fds = {"info": info_r, "result": result_r}
        job = {**job, "result_fd": result_w, "limits": rlimits(limits),
               "keyring": {"keyctl": seccomp.syscall_number("keyctl", arch),
                           "seal": seccomp.keyctl_seal_filter(arch).hex()}}
        job["harness"] = modules_for(job["role"])  # the role's code: the jail holds no dare_core
        self.pending = memoryview(json.dumps(job).encode("utf-8"))
        self.kept = {"stdout": bytearray(), "stderr": bytearray(), "info": bytearray(), "result": bytearray()}
        self.result_cap, self.result_overflow = RESULT_BYTES, False  # run_python may lower the cap
        passed = [info_w, result_w]  # the descriptors that only bubblewrap keeps
        try:
            image = runtime_image()
            passed.append(memfd("dare-seccomp", seccomp.jail_filter(arch)))
            seccomp_fd = passed[-1]
            with _STARTING:
                copies = open_for_jail(image)
                passed += [fd for fd, _ in copies]
                options, command = jail_command(image, copies, limits, info_w, seccomp_fd)
                passed.append(memfd("dare-bwrap-args", b"".join(o.encode() + b"\0" for o in options)))
                argv = [bwrap_path(), "--args", str(passed[-1]), *command]
                self.group = JailGroup.create(jail_memory_bytes(limits, image), jail_processes(limits), limits.cpus)
                if self.group is not None:
                    argv = self.group.wrap(argv)
                self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, env={}, pass_fds=(*passed, *pass_fds),
                                             start_new_session=True)
                for fd in passed[2:]:  # bubblewrap has them: the image's ~70 go at once
                    os.close(fd)
                del passed[2:]
        except BaseException:
            if self.group is not None:
                self.group.remove()
            for fd in self.fds.values():
                os.close(fd)
            raise
        finally:
            for fd in passed:
                os.close(fd)
        self.fds.update(stdout=self.proc.stdout.fileno(), stderr=self.proc.stderr.fileno())

    def kill(self) -> int:
        """Kill the jail's first process, the init of its PID namespace (the kernel then kills the
        whole namespace), and every process left in the jail's cgroup; return once the init is gone.
        bubblewrap reports the jailed program's exit before that init has finished tearing the
        namespace down, so its exit alone does not mean the jail is gone."""
        init = self._init_handle()
        try:
            if init is not None:
                try:
                    signal.pidfd_send_signal(init, signal.SIGKILL)
                except OSError:
                    pass
            if self.group is not None:
                # bubblewrap is spared so that it can reap the init it waits for
                self.group.kill_all(spare=self.proc.pid)
            try:
                returncode = self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                returncode = self.proc.wait()
            if self.group is not None:
                self.group.kill_all()  # whatever is left, bubblewrap's own processes included
            if init is not None:
                # readable once the init has exited, which the kernel allows only after every other
                # process of its namespace is gone
                select.select([init], [], [], 2.0)
            return returncode
        finally:
            if init is not None:
                os.close(init)

    def _init_handle(self) -> Optional[int]:
        """A pidfd of the jail's PID-namespace init (bubblewrap's child), checked to be that process
        and not a recycled pid: it must live in the jail's PID namespace."""
        try:  # what bubblewrap wrote that the pump did not read (it stops once its jail is done)
            os.set_blocking(self.fds["info"], False)
            while len(self.kept["info"]) < 65536:
                chunk = os.read(self.fds["info"], 65536)
                if not chunk:
                    break
                self.kept["info"] += chunk
        except OSError:
            pass
        info = self.info()
        child, namespace = info.get("child-pid"), info.get("pid-namespace")
        if type(child) is not int or type(namespace) is not int:
            return None
        try:
            handle = os.pidfd_open(child)  # pins the process: its pid cannot be recycled while open
        except OSError:
            return None
        try:
            if os.readlink(f"/proc/{child}/ns/pid") == f"pid:[{namespace}]":
                return handle
        except OSError:
            pass
        os.close(handle)
        return None

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
        for fd in (self.fds["info"], self.fds["result"]):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.group is not None:
            self.group.remove()
            self.group = None

    @property
    def started(self) -> bool:
        """Whether the start-up code ran (it writes READY first, before any untrusted code)."""
        return self.kept["result"].startswith(READY)

    def failure(self) -> str:
        """Why the jail never started: bubblewrap's own error, else its exit status."""
        lines = [ln for ln in self.kept["stderr"].decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else f"exit status {self.proc.returncode}"

    def info(self) -> dict:
        try:
            return json.loads(self.kept["info"].decode() or "{}")
        except ValueError:
            return {}


class RunClock:
    """A run's time limit (module docstring): `left()` says how long the pump may wait before it
    must look again, or which limit has run out."""

    def __init__(self, jails: Sequence[Jail], limits: SandboxLimits, started: float):
        self.groups = [jail.group for jail in jails]
        self.limit = limits.wall_s
        self.counts_cpu = all(g is not None and g.cpu_seconds() is not None for g in self.groups)
        self.deadline = started + limits.wall_s * (max(1.0, limits.backstop) if self.counts_cpu else 1.0)
        # the fastest the jails can spend CPU time together: the pump need not look before that
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        quotas = [g.cpus for g in self.groups if g is not None]
        self.rate = min(cores, sum(quotas)) if self.counts_cpu and quotas and all(quotas) else cores
        self.next_check = started

    def used(self) -> Optional[float]:
        """CPU seconds the jails have spent so far, where their groups count it."""
        if not self.counts_cpu:
            return None
        seconds = [g.cpu_seconds() for g in self.groups]
        return sum(seconds) if all(s is not None for s in seconds) else None

    def left(self) -> tuple[float, Optional[str]]:
        """(seconds the pump may wait, None), or (0, "cpu" | "wall") once a limit has run out. The
        groups' counters are read only once the jails could have spent what was left."""
        now = time.monotonic()
        wall = self.deadline - now
        if wall <= 0:
            return 0.0, "wall"
        if not self.counts_cpu or now < self.next_check:
            return (min(wall, self.next_check - now) if self.counts_cpu else wall), None
        used = self.used()
        if used is None:
            return wall, None
        if used >= self.limit:
            return 0.0, "cpu"
        wait = max(0.005, (self.limit - used) / self.rate)
        self.next_check = now + wait
        return min(wall, wait), None


def _pump(jails: list[Jail], limits: SandboxLimits, clock: RunClock, until: Jail) -> tuple[Optional[str], bool, bool]:
    """Feed the jobs and collect every stream until `until` has closed its output (done), the run's
    time is up or output floods (stdout and stderr past `flood_bytes`, or a result pipe past its
    jail's `result_cap`). Returns (which limit the run ran out of, "cpu" or "wall", or None;
    flooded; truncated)."""
    selector = selectors.DefaultSelector()
    caps = {"stdout": limits.output_bytes, "stderr": limits.output_bytes, "info": 65536}
    seen, truncated = 0, False
    for jail in jails:
        fd = jail.proc.stdin.fileno()
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_WRITE, (jail, "stdin"))
        for name, fd in jail.fds.items():
            selector.register(fd, selectors.EVENT_READ, (jail, name))
    open_streams = {jail.name: {"stdout", "stderr", "result"} for jail in jails}
    try:
        while open_streams[until.name]:
            remaining, expired = clock.left()
            if expired:
                return expired, False, truncated
            for key, _ in selector.select(remaining):
                jail, name = key.data
                if name == "stdin":
                    try:
                        jail.pending = jail.pending[os.write(key.fd, jail.pending[:65536]):]
                    except BlockingIOError:
                        continue
                    except OSError:
                        jail.pending = jail.pending[:0]
                    if not jail.pending:
                        selector.unregister(key.fd)
                        jail.proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    open_streams[jail.name].discard(name)
                    continue
                kept = jail.kept[name]
                room = (jail.result_cap if name == "result" else caps[name]) - len(kept)
                if room > 0:
                    kept += chunk[:room]
                if name == "result" and len(chunk) > room:
                    jail.result_overflow = True
                    return None, True, truncated
                if name in ("stdout", "stderr"):
                    truncated = truncated or len(chunk) > room
                    seen += len(chunk)
                    if seen > limits.flood_bytes:
                        return None, True, truncated
        return None, False, truncated
    finally:
        selector.close()
        for jail in jails:
            jail.exited_first = jail.proc.poll() is not None  # it ended before `_run` kills what is left
            # the loop may stop (its `until` jail done, a flood) before it read another jail's READY
            if "result" in open_streams[jail.name] and not jail.result_overflow:
                drain_pipe(jail.fds["result"], jail.kept["result"], jail.result_cap)


def run_jails(jails: list[Jail], limits: SandboxLimits, until: Jail,
              started: float) -> tuple[Optional[str], bool, bool, Optional[float]]:
    """Run `jails` until `until` is done, its time is up or output floods; kill and close every jail.
    Returns (the limit the run ran out of: "cpu", "wall" or None; flooded; truncated; the CPU
    seconds its jails spent, where counted)."""
    clock = RunClock(jails, limits, started)
    cpu_s = None
    try:
        timed_out, flooded, truncated = _pump(jails, limits, clock, until)
        # a jail that closed its pipes gets a moment to finish exiting; then every jail is killed
        grace = time.monotonic() + 0.5
        while not (timed_out or flooded) and until.proc.poll() is None and time.monotonic() < grace:
            time.sleep(0.002)
        for jail in jails:
            jail.kill()
        cpu_s = clock.used()  # every process of the jails is gone: their time is all counted
    finally:
        for jail in jails:
            if jail.proc.returncode is None:
                jail.kill()
            jail.close()
    return timed_out, flooded, truncated, cpu_s


