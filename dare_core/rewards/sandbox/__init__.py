"""An OS-level sandbox for untrusted Python (generated code); its threat model: docs/sandbox.md.

Candidate code runs in a process that the kernel isolates, never trusted to police itself:

- **A jail per process** (bubblewrap, `bwrap`): new PID, mount, network, IPC, UTS and cgroup
  namespaces. The process sees only its own PID namespace (nothing of the trainer to signal), has
  no network but an unconfigured loopback, and a read-only root that holds just its own copy of the
  Python interpreter, the standard library a run can use and the shared libraries they load
  (`runtime.py`): no host file, virtual environment, repository, home or /etc, and no inode shared
  with another jail. Its working directory is a private, size-capped tmpfs that disappears with it.
- **An unprivileged uid, also when the trainer is root.** Run by root, bubblewrap builds the jail
  without a user namespace and the start-up code drops to a fresh uid (random, far above real users)
  with no capabilities, so the process is unprivileged in the host's own user namespace too; run by
  another user, the jail is a user namespace mapping uid 65534 to that user.
- **A seccomp filter and an empty keyring** (`seccomp.py`): no namespaces, mounts, tracing, keyrings,
  file locks, change notification, page-cache probes, machine-wide counters or other kernel surfaces
  of the host.
- **Limits**: CPU seconds, address space, file size, open files and processes (`setrlimit` before
  any untrusted code), memory, problems and cores of the whole jail (a cgroup, `cgroup.py`), a time
  limit counted in the jails' own CPU time with a wall-clock backstop (`jail_run.py`), capped
  output, and a kill of the whole jail (its PID namespace and its cgroup) before the call returns.
- **Verdicts outside.** Stdin/stdout tests: the jail reports each case's raw output and the caller
  compares it with the expected output (`dare_core.rewards.code`). Assertion tests: the tests run
  in a second jail that never executes candidate code, against proxies of the program's names whose
  calls cross to the candidate's jail and return plain values (`_sandbox_child.py`), so no object,
  frame or function of the candidate's can decide the score.

Without bubblewrap (or where the kernel refuses its namespaces) `SandboxUnavailable` is raised:
there is no weaker fallback. `make sandbox` installs it (Debian/Ubuntu package `bubblewrap`).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dare_core.rewards.sandbox._verdict import never_started, parse_verdict, result_cap
from dare_core.rewards.sandbox.jail import SandboxLimits
from dare_core.rewards.sandbox.unavailable import INSTALL_HINT, SandboxUnavailable
from dare_core.rewards.sandbox.jail_run import READY, Jail, run_jails
from dare_core.rewards.sandbox.test_names import names_for

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "check_available", "run_python"]

# the candidate's jail of a test run writes only READY on its result pipe (`jail_run.RESULT_BYTES`)
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
    cpu_s: Optional[float] = None  # CPU time of the run's jails together, where their cgroups count it
    cases: list = field(default_factory=list)  # stdin/stdout tests: one dict per case
    jails: list = field(default_factory=list)  # bubblewrap's info per jail: child-pid, pid-namespace, ...


def _verdict(jail: Jail, limits: SandboxLimits, cases: Optional[int]) -> tuple[Optional[dict], str]:
    """The jail's result message, checked (`parse_verdict`), or (None, why it is unusable)."""
    raw = bytes(jail.kept["result"][len(READY):])
    if jail.result_overflow or len(jail.kept["result"]) >= jail.result_cap:
        return None, f"result message over {jail.result_cap - len(READY)} bytes"
    if not raw:
        return None, ""  # no message at all: the process died first (`_crash` says how)
    message, problem = parse_verdict(raw, limits, cases)
    return message, problem or ""


def _timeout(limit: str, limits: SandboxLimits, cpu_s: Optional[float]) -> str:
    """Which of the run's time limits it ran out of, in words (`jail_run.RunClock`)."""
    if limit == "cpu":
        return f"CPU time limit {limits.wall_s:g} s (the CPU time of the run's own processes)"
    if cpu_s is None:
        return f"wall clock limit {limits.wall_s:g} s"
    return (f"wall clock backstop {limits.wall_s * max(1.0, limits.backstop):g} s after {cpu_s:.1f} s of CPU time "
            f"(limit {limits.wall_s:g} s): the program waited (sleep, a blocking call)")


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
      tests see is the problem's choice (`test_names.py`): `names`, its declared entry
      points, else the names the tests use without defining them; `required` must exist.
    - `inputs` (stdin/stdout tests): the program runs once per input, as `__main__`, with that input
      on stdin; `result.cases[i]["stdout"]` holds its output, and `passed` only says that every case
      finished cleanly (the caller compares the outputs).
    - neither: the program runs once with empty stdin; `passed` says it finished cleanly.
    """
    limits = limits or SandboxLimits()
    started = time.monotonic()
    if tests is None:
        jail = Jail("program", {"role": "stdio", "program": program, "case_output_bytes": limits.output_bytes,
                                 "inputs": list(inputs) if inputs is not None else [""]}, limits)
        jails, until, cases = [jail], jail, len(inputs) if inputs is not None else 1
        jail.result_cap = len(READY) + result_cap(limits, cases)
    else:
        names, modules = names_for(tests, names)
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        try:
            candidate = Jail("program", {"role": "serve", "program": program, "channel": [requests_r, replies_w],
                                          "names": names}, limits, pass_fds=(requests_r, replies_w))
            try:
                judge = Jail("tests", {"role": "tests", "tests": tests, "channel": [replies_r, requests_w],
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
    timed_out, flooded, truncated, cpu_s = run_jails(jails, limits, until, started)
    program_jail = jails[0]
    result = SandboxResult(passed=False, status="failed", timed_out=bool(timed_out), truncated=truncated, cpu_s=cpu_s,
                           stdout=program_jail.kept["stdout"].decode("utf-8", "replace"),
                           stderr=program_jail.kept["stderr"].decode("utf-8", "replace"),
                           wall_s=time.monotonic() - started, jails=[j.info() for j in jails])
    # the start-up code writes READY before any untrusted code runs: a jail that never got there
    # failed to be built, which is never the candidate's failure (nor a score of 0)
    broken = never_started(jails, until, timed_out, flooded)
    if broken is not None:
        raise SandboxUnavailable(f"the code sandbox could not start ({broken.failure()}); {INSTALL_HINT}")
    if timed_out:
        result.status, result.error = "timeout", _timeout(timed_out, limits, cpu_s)
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
