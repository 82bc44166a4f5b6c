"""An OS-level sandbox for untrusted Python (generated code); its threat model: docs/sandbox.md.

Candidate code runs in a process that the kernel isolates, never trusted to police itself:

- **A jail per process** (bubblewrap, `bwrap`): new PID, mount, network, IPC, UTS and cgroup
  namespaces. The process sees only its own PID namespace (nothing of the trainer to signal), has
  no network but an unconfigured loopback, and a read-only root that holds just the Python
  interpreter, its standard library (site-packages hidden) and the shared libraries they load: no
  virtual environment, no repository, no home, no /etc. Its working directory is a private,
  size-capped tmpfs that disappears with it.
- **An unprivileged uid, also when the trainer is root.** Run by root, bubblewrap builds the jail
  without a user namespace and the start-up code drops to a fresh uid (random, far above real users)
  with no capabilities, so the process is unprivileged in the host's own user namespace too; run by
  another user, the jail is a user namespace mapping uid 65534 to that user.
- **A seccomp filter and an empty keyring** (`seccomp.py`): no namespaces, mounts, tracing, keyrings
  or other kernel surfaces of the host.
- **Limits**: CPU seconds, address space, file size, open files and processes (`setrlimit` before
  any untrusted code), memory and tasks of the whole jail (a cgroup, `cgroup.py`), a wall-clock
  deadline, capped output, and a kill of the whole jail (its PID namespace and its cgroup) before
  the call returns.
- **Verdicts outside.** Stdin/stdout tests: the jail reports each case's raw output and the caller
  compares it with the expected output (`dare_core.rewards.code`). Assertion tests: the tests run
  in a second jail that never executes candidate code, against proxies of the program's names whose
  calls cross to the candidate's jail and return plain values (`_sandbox_child.py`), so no object,
  frame or function of the candidate's can decide the score.

Without bubblewrap (or where the kernel refuses its namespaces) `SandboxUnavailable` is raised:
there is no weaker fallback. `make sandbox` installs it (Debian/Ubuntu package `bubblewrap`).
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
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dare_core.rewards._verdict import drain_pipe, never_started, parse_verdict, result_cap
import dare_core.rewards.seccomp as seccomp
from dare_core.rewards.cgroup import JailGroup
from dare_core.rewards.harness import modules_for
from dare_core.rewards.jail import (INSTALL_HINT, SandboxLimits, SandboxUnavailable, bwrap_path, jail_command,
                                    jail_memory_bytes, jail_tasks, memfd, rlimits, runtime)
from dare_core.rewards.task_names import names_for

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "check_available", "run_python"]

READY = b"R"  # the start-up code's first byte on its result pipe
# Result-pipe caps. Whatever reaches the trainer through a pipe is bounded by what an honest start-up
# code writes: the tests' jail a short verdict, the candidate's jail of a test run only READY, and a
# stdin/stdout jail one entry per case whose output is already cut at `limits.output_bytes`
# (`_verdict.result_cap`). A jail writing more is stopped and scores 0 ("malformed").
_RESULT_BYTES = 64 * 1024
_READY_ONLY_BYTES = 4096


@dataclass
class SandboxResult:
    passed: bool
    status: str  # passed | failed | timeout | output_limit | crashed | malformed (an unusable result message)
    timed_out: bool = False
    error: Optional[str] = None
    stdout: str = ""  # the program's (the candidate's jail)
    stderr: str = ""
    truncated: bool = False
    wall_s: float = 0.0
    cases: list = field(default_factory=list)  # stdin/stdout tests: one dict per case
    jails: list = field(default_factory=list)  # bubblewrap's info per jail: child-pid, pid-namespace, ...


# ---- running jails ---------------------------------------------------------------------------------

class _Jail:
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
        self.result_cap, self.result_overflow = _RESULT_BYTES, False  # run_python may lower the cap
        passed = [info_w, result_w]  # the descriptors that only bubblewrap keeps
        try:
            passed.append(memfd("dare-seccomp", seccomp.jail_filter(arch)))
            options, command = jail_command(runtime(), limits, info_w, passed[-1])
            passed.append(memfd("dare-bwrap-args", b"".join(o.encode() + b"\0" for o in options)))
            argv = [bwrap_path(), "--args", str(passed[-1]), *command]
            self.group = JailGroup.create(jail_memory_bytes(limits), jail_tasks(limits))
            if self.group is not None:
                argv = self.group.wrap(argv)
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         env={}, pass_fds=(*passed, *pass_fds), start_new_session=True)
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


def _pump(jails: list[_Jail], limits: SandboxLimits, deadline: float, until: _Jail) -> tuple[bool, bool, bool]:
    """Feed the jobs and collect every stream until `until` has closed its output (done), the
    deadline passes or output floods (stdout and stderr past `flood_bytes`, or a result pipe past its
    jail's `result_cap`). Returns (timed_out, flooded, truncated)."""
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
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True, False, truncated
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
                    return False, True, truncated
                if name in ("stdout", "stderr"):
                    truncated = truncated or len(chunk) > room
                    seen += len(chunk)
                    if seen > limits.flood_bytes:
                        return False, True, truncated
        return False, False, truncated
    finally:
        selector.close()
        for jail in jails:
            jail.exited_first = jail.proc.poll() is not None  # it ended before `_run` kills what is left
            # the loop may stop (its `until` jail done, a flood) before it read another jail's READY
            if "result" in open_streams[jail.name] and not jail.result_overflow:
                drain_pipe(jail.fds["result"], jail.kept["result"], jail.result_cap)


def _run(jails: list[_Jail], limits: SandboxLimits, until: _Jail, started: float):
    try:
        timed_out, flooded, truncated = _pump(jails, limits, started + limits.wall_s, until)
        # a jail that closed its pipes gets a moment to finish exiting; then every jail is killed
        grace = time.monotonic() + 0.5
        while not (timed_out or flooded) and until.proc.poll() is None and time.monotonic() < grace:
            time.sleep(0.002)
        for jail in jails:
            jail.kill()
    finally:
        for jail in jails:
            if jail.proc.returncode is None:
                jail.kill()
            jail.close()
    return timed_out, flooded, truncated


def _verdict(jail: _Jail, limits: SandboxLimits, cases: Optional[int]) -> tuple[Optional[dict], str]:
    """The jail's result message, checked (`parse_verdict`), or (None, why it is unusable)."""
    raw = bytes(jail.kept["result"][len(READY):])
    if jail.result_overflow or len(jail.kept["result"]) >= jail.result_cap:
        return None, f"result message over {jail.result_cap - len(READY)} bytes"
    if not raw:
        return None, ""  # no message at all: the process died first (`_crash` says how)
    message, problem = parse_verdict(raw, limits, cases)
    return message, problem or ""


def _crash(returncode: Optional[int], stderr: bytes) -> str:
    # bubblewrap exits with 128 + N when the jailed process died of signal N
    signum = -returncode if returncode is not None and returncode < 0 else (
        returncode - 128 if returncode is not None and returncode > 128 else None)
    if signum is not None:
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        return f"killed by {name}" + (" (CPU limit)" if name == "SIGXCPU" else "")
    lines = [line for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    return f"exited with status {returncode} before reporting" + (f": {lines[-1][:300]}" if lines else "")


def run_python(program: str, tests: Optional[str] = None, inputs: Optional[Sequence[str]] = None,
               limits: Optional[SandboxLimits] = None, names: Optional[Sequence[str]] = None,
               required: Sequence[str] = ()) -> SandboxResult:
    """Run `program` in the sandbox.

    - `tests` (assertion tests): they run in a jail of their own against the program's names (also
      importable as module `solution`); top-level `test*` functions and `Test*`/`unittest` classes are
      run too. Passes when the tests complete without an exception. Which of the program's names the
      tests see is the task's choice (`dare_core.rewards.task_names`): `names`, its declared entry
      points, else the names the tests use without defining them; `required` must exist.
    - `inputs` (stdin/stdout tests): the program runs once per input, as `__main__`, with that input
      on stdin; `result.cases[i]["stdout"]` holds its output, and `passed` only says that every case
      finished cleanly (the caller compares the outputs).
    - neither: the program runs once with empty stdin; `passed` says it finished cleanly.
    """
    limits = limits or SandboxLimits()
    started = time.monotonic()
    if tests is None:
        jail = _Jail("program", {"role": "stdio", "program": program, "case_output_bytes": limits.output_bytes,
                                 "inputs": list(inputs) if inputs is not None else [""]}, limits)
        jails, until, cases = [jail], jail, len(inputs) if inputs is not None else 1
        jail.result_cap = len(READY) + result_cap(limits, cases)
    else:
        names, modules = names_for(tests, names)
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        try:
            candidate = _Jail("program", {"role": "serve", "program": program, "channel": [requests_r, replies_w],
                                          "names": names}, limits, pass_fds=(requests_r, replies_w))
            try:
                judge = _Jail("tests", {"role": "tests", "tests": tests, "channel": [replies_r, requests_w],
                                        "names": names, "required": list(required), "modules": modules},
                              limits, pass_fds=(replies_r, requests_w))
            except BaseException:
                candidate.kill()
                candidate.close()
                raise
        finally:
            for fd in (requests_r, requests_w, replies_r, replies_w):
                os.close(fd)
        jails, until, cases = [candidate, judge], judge, None
        # the candidate's start-up code writes only READY there; anything more is the candidate's
        candidate.result_cap = _READY_ONLY_BYTES
    timed_out, flooded, truncated = _run(jails, limits, until, started)
    program_jail = jails[0]
    result = SandboxResult(passed=False, status="failed", timed_out=timed_out, truncated=truncated,
                           stdout=program_jail.kept["stdout"].decode("utf-8", "replace"),
                           stderr=program_jail.kept["stderr"].decode("utf-8", "replace"),
                           wall_s=time.monotonic() - started, jails=[j.info() for j in jails])
    # the start-up code writes READY before any untrusted code runs: a jail that never got there
    # failed to be built, which is never the candidate's failure (nor a score of 0)
    broken = never_started(jails, until, timed_out, flooded)
    if broken is not None:
        raise SandboxUnavailable(f"the code sandbox could not start ({broken.failure()}); {INSTALL_HINT}")
    if timed_out:
        result.status, result.error = "timeout", f"wall clock limit {limits.wall_s:g} s"
        return result
    overflow = next((j for j in jails if j.result_overflow), None)
    if overflow is not None:
        result.status, result.error = "malformed", f"result message over {overflow.result_cap - len(READY)} bytes"
        return result
    if flooded:
        result.status, result.error = "output_limit", f"more than {limits.flood_bytes} bytes of output"
        return result
    message, problem = _verdict(until, limits, cases)
    if message is None:
        result.status = "malformed" if problem else "crashed"
        result.error = problem or _crash(until.proc.returncode, until.kept["stderr"])
        return result
    result.cases = message.get("cases", [])
    if tests is None:
        failed = next((c for c in result.cases if not c["ok"]), None)
        result.error = message.get("error") or (failed or {}).get("error")
        result.passed = bool(result.cases) and failed is None and "error" not in message
    else:
        result.error = message["error"]
        result.passed = message["ok"]
    result.status = "passed" if result.passed else "failed"
    return result

_CHECKED: Optional[str] = None
_CHECK_LOCK = threading.Lock()


def check_available() -> str:
    """Raise SandboxUnavailable unless a jail can be built and runs Python here; returns the mode
    ("setuid" when the trainer is root, else "userns"). Checked once per process."""
    global _CHECKED
    with _CHECK_LOCK:  # parallel scoring: one probe, not one per thread
        if _CHECKED is None:
            probe = run_python("print(6 * 7)", limits=SandboxLimits(wall_s=30))
            if not probe.passed or probe.cases[0]["stdout"] != "42\n":
                raise SandboxUnavailable(f"the code sandbox does not work here ({probe.status}: {probe.error}); "
                                         f"{INSTALL_HINT}")
            _CHECKED = "setuid" if os.geteuid() == 0 else "userns"
        return _CHECKED
