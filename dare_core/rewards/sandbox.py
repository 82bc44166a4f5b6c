"""A local sandbox for untrusted Python (generated code and its tests), ALGORITHMS.md section 7.

Each run is a fresh child process, with these layers:

1. **Process group, wall clock, output.** The child starts in its own session (`setsid`); the parent
   reads its stdout/stderr and verdict pipes with a deadline, keeps the first `output_bytes` of each
   stream, kills the child when it floods more than `flood_bytes`, and always ends by killing the
   whole process group (before reaping the leader, so the group id cannot have been reused).
2. **Private working directory.** A new `0700` temporary directory is the child's cwd, HOME and
   TMPDIR, and is deleted afterwards. The environment is rebuilt from scratch.
3. **Resource limits** (`setrlimit` in the child, soft = hard, before any untrusted code): CPU
   seconds, address space, file size, open files, no core dumps, no locked memory, and a process
   count where the kernel enforces it (not for uid 0 outside a user namespace).
4. **Audit hook** (`sys.addaudithook`, cannot be removed; see `_sandbox_child.py`): no network
   sockets (AF_UNIX socket pairs only) or name lookups, no fork/exec/spawn/subprocess, no ctypes or
   foreign native modules, no file access outside the working directory except read-only opens of
   the Python installation, no rlimit changes. Any refusal fails the run, even when the program
   catches the error; a refused import only looks like a missing module. The child runs
   `python -s -S -B` (no site-packages unless asked, no user site, no bytecode writes).
5. **Kernel isolation when the host allows it** (probed once, see `isolation_layers()`): a new
   network namespace (`unshare --net`, with `--user --map-root-user` when not root), so even a
   socket that slipped through has no route anywhere; and, when running as root, all capabilities
   and the bounding set dropped with no-new-privs (`setpriv`), so root cannot raise its limits,
   `chroot`, `mknod` devices or override file permissions.

What it is not: a defence against a deliberate attack on CPython itself (memory-corruption bugs), and
the verdict is produced inside the child, so code that introspects the harness could forge it; exiting
early (`sys.exit`, `os._exit`) or raising never passes, because the verdict is written only after the
tests complete. The root filesystem is protected by the audit hook (and by file permissions when
not root), not by a read-only mount.

`run_python` returns a `SandboxResult`; `dare_core.rewards.code` builds the `code` reward on it.
"""
from __future__ import annotations

import ast
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

_CHILD_SOURCE = Path(__file__).with_name("_sandbox_child.py").read_text()
_VERDICT_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall clock for the whole run (all stdin/stdout cases together)
    cpu_s: int = 10
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file the child may write
    open_files: int = 64
    processes: int = 16  # RLIMIT_NPROC headroom over the processes the user already runs
    max_created_files: int = 64
    output_bytes: int = 64 * 1024  # kept per stream (and per stdin/stdout case)
    flood_bytes: int = 8 * 1024 * 1024  # more than this on stdout+stderr kills the child
    namespaces: bool = True  # use the kernel layers when available
    site_packages: bool = False  # let the program import installed third-party packages


@dataclass
class SandboxResult:
    passed: bool
    status: str  # passed | failed | timeout | refused | output_limit | crashed | error
    timed_out: bool = False
    refused: Optional[str] = None  # the first thing the audit hook refused
    error: Optional[str] = None
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    returncode: Optional[int] = None
    wall_s: float = 0.0
    pid: int = 0
    cases: list = field(default_factory=list)  # stdin/stdout tests: one dict per case
    layers: tuple = ()


# ---- kernel layers -------------------------------------------------------------------------------

_PROBE_LOCK = threading.Lock()
_PROBED: Optional[tuple[list[str], tuple[str, ...]]] = None


def _candidates() -> list[tuple[list[str], tuple[str, ...]]]:
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    root = os.geteuid() == 0
    net: Optional[list[str]] = None
    if unshare:
        net = [unshare, "--net"] if root else [unshare, "--user", "--map-root-user", "--net"]
    net_layers = ("netns",) if root else ("userns", "netns")
    drop = [setpriv, "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"] if setpriv else None
    out = []
    if net and drop:
        out.append((net + drop, net_layers + ("no_caps", "no_new_privs")))
    if net:
        out.append((net, net_layers))
    if drop and root:
        out.append((drop, ("no_caps", "no_new_privs")))
    if setpriv:
        out.append(([setpriv, "--no-new-privs"], ("no_new_privs",)))
    return out


def _probe() -> tuple[list[str], tuple[str, ...]]:
    for prefix, layers in _candidates():
        try:
            done = subprocess.run(prefix + [sys.executable, "-s", "-S", "-c", "pass"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return prefix, layers
    return [], ()


def isolation_layers(namespaces: bool = True) -> tuple[list[str], tuple[str, ...]]:
    """The command prefix for the kernel layers that work here, and their names (probed once)."""
    global _PROBED
    if not namespaces:
        return [], ()
    with _PROBE_LOCK:
        if _PROBED is None:
            _PROBED = _probe()
        return list(_PROBED[0]), _PROBED[1]


def _read_roots(site_packages: bool, only_site: bool = False) -> list[str]:
    """Directories the child may read (the Python installation), symlinks resolved."""
    paths = sysconfig.get_paths()
    keys = [] if only_site else ["stdlib", "platstdlib"]
    keys += ["purelib", "platlib"] if site_packages else []
    roots = []
    for key in keys:
        if paths.get(key):
            real = os.path.realpath(paths[key])
            if real not in roots and real != "/":
                roots.append(real)
    return roots


def _user_process_count() -> int:
    """Processes of our real uid, which RLIMIT_NPROC counts (outside a user namespace)."""
    uid, count = os.getuid(), 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for entry in entries:
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


# ---- running -------------------------------------------------------------------------------------


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid and group id stay reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _pump(proc: subprocess.Popen, verdict_fd: int, job: bytes, limits: SandboxLimits, deadline: float):
    """Feed the job, collect the streams until EOF, the deadline or a flood. Returns
    (stdout, stderr, verdict bytes, timed_out, flooded, truncated)."""
    kept = {"stdout": bytearray(), "stderr": bytearray(), "verdict": bytearray()}
    caps = {"stdout": limits.output_bytes, "stderr": limits.output_bytes, "verdict": _VERDICT_BYTES}
    seen, truncated, timed_out, flooded = 0, False, False, False
    selector = selectors.DefaultSelector()
    stdin_fd = proc.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    selector.register(stdin_fd, selectors.EVENT_WRITE, "stdin")
    selector.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
    selector.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
    selector.register(verdict_fd, selectors.EVENT_READ, "verdict")
    pending = memoryview(job)
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(remaining):
                name = key.data
                if name == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except BlockingIOError:
                        continue
                    except OSError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(key.fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                room = caps[name] - len(kept[name])
                if room > 0:
                    kept[name] += chunk[:room]
                if len(chunk) > room:
                    truncated = truncated or name != "verdict"
                if name != "verdict":
                    seen += len(chunk)
                    if seen > limits.flood_bytes:
                        flooded = True
                        break
            if flooded:
                break
    finally:
        selector.close()
    return bytes(kept["stdout"]), bytes(kept["stderr"]), bytes(kept["verdict"]), timed_out, flooded, truncated


def _parse_verdict(raw: bytes, nonce: str) -> Optional[dict]:
    for line in raw.decode("utf-8", "replace").split("\n"):
        if line.startswith(nonce):
            try:
                value = ast.literal_eval(line[len(nonce):])
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
            return value if isinstance(value, dict) else None
    return None


def run_python(program: str, tests: Optional[str] = None, inputs: Optional[Sequence[str]] = None,
               limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run `program` in the sandbox.

    - `tests` (assertion tests): run after the program in its namespace (also importable as module
      `solution`); top-level `test*` functions they define are called too. Passes when everything
      completes without an exception.
    - `inputs` (stdin/stdout tests): the program runs once per input, as `__main__`, with that input
      on stdin; `result.cases[i]["stdout"]` holds its output and `passed` only says that every case
      finished cleanly (the caller compares the outputs).
    """
    limits = limits or SandboxLimits()
    prefix, layers = isolation_layers(limits.namespaces)
    # uid 0 outside a user namespace is exempt from RLIMIT_NPROC; otherwise the kernel counts every
    # process (and thread) of the real uid (per user namespace since Linux 5.14): leave headroom.
    nproc = None if os.geteuid() == 0 and "userns" not in layers else _user_process_count() + limits.processes
    work = os.path.realpath(tempfile.mkdtemp(prefix="dare-sandbox-"))
    verdict_r, verdict_w = os.pipe()
    nonce = secrets.token_hex(16)
    job = {
        "nonce": nonce, "result_fd": verdict_w, "workdir": work, "read_roots": _read_roots(limits.site_packages),
        "program": program, "tests": tests, "inputs": list(inputs) if inputs is not None else None,
        "max_created_files": limits.max_created_files, "case_output_bytes": limits.output_bytes,
        "limits": {"cpu_s": int(math.ceil(limits.cpu_s)), "memory_bytes": limits.memory_mb << 20,
                   "file_bytes": limits.file_mb << 20, "open_files": limits.open_files, "processes": nproc},
    }
    payload = json.dumps(job).encode("utf-8")
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "USER": "sandbox", "LOGNAME": "sandbox",
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
           "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if limits.site_packages:
        env["PYTHONPATH"] = os.pathsep.join(_read_roots(True, only_site=True))
    command = prefix + [sys.executable, "-s", "-S", "-B", "-c", _CHILD_SOURCE]
    started = time.monotonic()
    proc = None
    try:
        os.chmod(work, 0o700)
        # the program's source as a file, so tracebacks and `inspect.getsource` work (not the tests)
        with open(os.path.join(work, "solution.py"), "w", encoding="utf-8") as f:
            f.write(program)
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=work, env=env, pass_fds=(verdict_w,), start_new_session=True)
        os.close(verdict_w)
        verdict_w = -1
        stdout, stderr, verdict, timed_out, flooded, truncated = _pump(
            proc, verdict_r, payload, limits, started + limits.wall_s)
        # Give a child that closed its pipes a moment to finish exiting, then kill the whole group
        # while the leader is still unreaped.
        grace = time.monotonic() + 0.5
        while not (timed_out or flooded) and not _exited(proc.pid) and time.monotonic() < grace:
            time.sleep(0.002)
        _kill_group(proc.pid)
        returncode = proc.wait()
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
            proc.wait()
        for fd in (verdict_r, verdict_w):
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
        shutil.rmtree(work, ignore_errors=True)
    wall = time.monotonic() - started
    result = SandboxResult(passed=False, status="failed", timed_out=timed_out, truncated=truncated,
                           stdout=stdout.decode("utf-8", "replace"), stderr=stderr.decode("utf-8", "replace"),
                           returncode=returncode, wall_s=wall, pid=proc.pid,
                           layers=layers + ("setsid", "workdir", "rlimits", "audit_hook"))
    if timed_out:
        result.status, result.error = "timeout", f"wall clock limit {limits.wall_s:g} s"
        return result
    if flooded:
        result.status, result.error = "output_limit", f"more than {limits.flood_bytes} bytes of output"
        return result
    message = _parse_verdict(verdict, nonce)
    if message is None:
        result.status = "crashed"
        if returncode is not None and returncode < 0:
            name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
            result.error = f"killed by {name}" + (" (CPU limit)" if name == "SIGXCPU" else "")
        else:
            result.error = f"exited with status {returncode} before the tests finished"
        return result
    refusals = message.get("refusals") or []
    result.refused = refusals[0] if refusals else None
    result.error = message.get("error") or (f"refused: {result.refused}" if result.refused else None)
    result.cases = list(message.get("cases") or [])
    if message.get("ok") and not refusals:
        result.passed, result.status = True, "passed"
    else:
        result.status = "refused" if result.refused else "failed"
    return result
