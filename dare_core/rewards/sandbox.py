"""An OS-level sandbox for untrusted Python (generated code), ALGORITHMS.md section 7.

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
- **Limits**: CPU seconds, address space, file size, open files and processes (`setrlimit` before
  any untrusted code), a wall-clock deadline, capped output, and a kill of the whole jail (its PID
  namespace dies with its first process; `--die-with-parent` also covers a trainer that dies).
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
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dare_core.rewards.jail import INSTALL_HINT, SandboxLimits, SandboxUnavailable, jail_command, rlimits, runtime

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "check_available", "run_python"]

_RESULT_BYTES = 64 * 1024 * 1024
READY = b"R"  # the start-up code's first byte on its result pipe


@dataclass
class SandboxResult:
    passed: bool
    status: str  # passed | failed | timeout | output_limit | crashed
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
        info_r, info_w = os.pipe()
        result_r, result_w = os.pipe()
        self.fds = {"info": info_r, "result": result_r}
        job = {**job, "result_fd": result_w, "limits": rlimits(limits)}
        self.pending = memoryview(json.dumps(job).encode("utf-8"))
        self.kept = {"stdout": bytearray(), "stderr": bytearray(), "info": bytearray(), "result": bytearray()}
        try:
            self.proc = subprocess.Popen(jail_command(runtime(), limits, info_w), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                         pass_fds=(info_w, result_w, *pass_fds), start_new_session=True)
        finally:
            os.close(info_w)
            os.close(result_w)
        self.fds.update(stdout=self.proc.stdout.fileno(), stderr=self.proc.stderr.fileno())

    def kill(self) -> int:
        """Kill the jail's first process (the kernel then kills its whole PID namespace), so that
        bubblewrap reaps it and exits; bubblewrap itself is the fallback."""
        child = self.info().get("child-pid")
        if type(child) is int and self.proc.poll() is None:
            try:
                handle = os.pidfd_open(child)  # pins the process: no pid reuse between check and kill
            except OSError:
                handle = None
            if handle is not None:
                try:
                    if _parent(child) == self.proc.pid:
                        signal.pidfd_send_signal(handle, signal.SIGKILL)
                except OSError:
                    pass
                finally:
                    os.close(handle)
        try:
            return self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return self.proc.wait()

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


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _pump(jails: list[_Jail], limits: SandboxLimits, deadline: float, until: _Jail) -> tuple[bool, bool, bool]:
    """Feed the jobs and collect every stream until `until` has closed its output (done), the
    deadline passes or output floods. Returns (timed_out, flooded, truncated)."""
    selector = selectors.DefaultSelector()
    caps = {"stdout": limits.output_bytes, "stderr": limits.output_bytes, "info": 65536, "result": _RESULT_BYTES}
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
                room = caps[name] - len(kept)
                if room > 0:
                    kept += chunk[:room]
                if name in ("stdout", "stderr"):
                    truncated = truncated or len(chunk) > room
                    seen += len(chunk)
                    if seen > limits.flood_bytes:
                        return False, True, truncated
        return False, False, truncated
    finally:
        selector.close()


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


def _verdict(raw: bytes) -> Optional[dict]:
    try:
        value = json.loads(raw.decode("utf-8"))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


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
               limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run `program` in the sandbox.

    - `tests` (assertion tests): they run in a jail of their own against the program's names (also
      importable as module `solution`); top-level `test*` functions and `Test*`/`unittest` classes are
      run too. Passes when the tests complete without an exception.
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
        jails, until = [jail], jail
    else:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        try:
            candidate = _Jail("program", {"role": "serve", "program": program, "channel": [requests_r, replies_w]},
                              limits, pass_fds=(requests_r, replies_w))
            try:
                judge = _Jail("tests", {"role": "tests", "tests": tests, "channel": [replies_r, requests_w]},
                              limits, pass_fds=(replies_r, requests_w))
            except BaseException:
                candidate.kill()
                candidate.close()
                raise
        finally:
            for fd in (requests_r, requests_w, replies_r, replies_w):
                os.close(fd)
        jails, until = [candidate, judge], judge
    timed_out, flooded, truncated = _run(jails, limits, until, started)
    program_jail = jails[0]
    result = SandboxResult(passed=False, status="failed", timed_out=timed_out, truncated=truncated,
                           stdout=program_jail.kept["stdout"].decode("utf-8", "replace"),
                           stderr=program_jail.kept["stderr"].decode("utf-8", "replace"),
                           wall_s=time.monotonic() - started, jails=[j.info() for j in jails])
    for jail in jails:
        # the start-up code writes READY before any untrusted code runs: a jail that never got there
        # failed to be built, which is never the candidate's failure (nor a score of 0)
        if not jail.started and not timed_out:
            raise SandboxUnavailable(f"the code sandbox could not start ({jail.failure()}); {INSTALL_HINT}")
    if timed_out:
        result.status, result.error = "timeout", f"wall clock limit {limits.wall_s:g} s"
        return result
    if flooded:
        result.status, result.error = "output_limit", f"more than {limits.flood_bytes} bytes of output"
        return result
    message = _verdict(bytes(until.kept["result"][len(READY):])) if until.started else None
    if message is None:
        result.status, result.error = "crashed", _crash(until.proc.returncode, until.kept["stderr"])
        return result
    result.cases = list(message.get("cases") or [])
    if tests is None:
        failed = next((c for c in result.cases if not c.get("ok")), None)
        result.error = message.get("error") or (failed or {}).get("error")
        result.passed = bool(result.cases) and failed is None and "error" not in message
    else:
        result.error = message.get("error")
        result.passed = message.get("ok") is True
    result.status = "passed" if result.passed else "failed"
    return result


_CHECKED: Optional[str] = None


def check_available() -> str:
    """Raise SandboxUnavailable unless a jail can be built and runs Python here; returns the mode
    ("setuid" when the trainer is root, else "userns"). Checked once per process."""
    global _CHECKED
    if _CHECKED is None:
        probe = run_python("print(6 * 7)", limits=SandboxLimits(wall_s=30))
        if not probe.passed or probe.cases[0]["stdout"] != "42\n":
            raise SandboxUnavailable(f"the code sandbox does not work here ({probe.status}: {probe.error}); {INSTALL_HINT}")
        _CHECKED = "setuid" if os.geteuid() == 0 else "userns"
    return _CHECKED
