"""The jail of the code sandbox: what it holds and bubblewrap's command line for it.

A jail holds the interpreter (at /py/bin/python3), its standard library (site-packages hidden), the
shared libraries they load (found once with `ldd`) and a private tmpfs at /sandbox; the root is
read-only. Run by root, bubblewrap builds it without a user namespace and the start-up code
(`_sandbox_child.py`) drops to a random uid of the host with no capabilities; run by another user,
it is a user namespace mapping uid 65534 to that user. Either way a seccomp filter
(`dare_core.rewards.seccomp`) closes keyrings, namespaces, mounts and tracing, and a cgroup per jail
(`dare_core.rewards.cgroup`) bounds it as a whole. `dare_core.rewards.sandbox` runs jails.
"""
from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dare_core.errors import UserError

CHILD_SOURCE = Path(__file__).with_name("_sandbox_child.py").read_text()
INSTALL_HINT = "install bubblewrap (`make sandbox`, or `apt-get install bubblewrap`)"


class SandboxUnavailable(UserError):
    """The OS-level sandbox cannot run here; code is never run without it."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall clock for the whole run (both jails, every stdin/stdout case)
    cpu_s: int = 10  # per process
    memory_mb: int = 1024  # address space per process; with a cgroup, also the jail's memory (+ work_mb)
    file_mb: int = 16  # largest file a process may write
    work_mb: int = 64  # size of the private tmpfs working directory
    open_files: int = 64
    processes: int = 16  # processes and threads of one jail's uid (and of the whole jail, with a cgroup)
    output_bytes: int = 64 * 1024  # kept per stream (and per stdin/stdout case)
    flood_bytes: int = 8 * 1024 * 1024  # more than this on stdout+stderr kills the jails


@dataclass(frozen=True)
class Runtime:
    """The interpreter, its standard library and the shared libraries they load (host paths)."""

    executable: str
    stdlib: str
    loader: str  # the ELF interpreter, bound at its own path
    libraries: tuple  # bound into /py/lib, found through LD_LIBRARY_PATH


_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


def _shared_libraries(files: list[str]) -> tuple[str, list[str]]:
    """(loader, libraries) that `files` load, from one `ldd` run."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("the sandbox needs `ldd` to find the interpreter's shared libraries")
    done = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60, env={"LC_ALL": "C"})
    loader, libraries = None, []
    for line in done.stdout.splitlines():
        match = _LDD_LINE.match(line)
        if not match:
            continue
        path = match.group(1)
        if "=>" not in line and os.path.basename(path).startswith("ld-"):
            loader = path
        elif path not in libraries:
            libraries.append(path)
    if loader is None:
        raise SandboxUnavailable(f"cannot find the ELF loader of {files[0]} (ldd said: {done.stderr.strip()[:200]})")
    return loader, libraries


_RUNTIME_LOCK = threading.Lock()
_RUNTIME: Optional[Runtime] = None


def runtime() -> Runtime:
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
            stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
            if not os.path.isfile(os.path.join(stdlib, "os.py")):
                raise SandboxUnavailable(f"no standard library at {stdlib}")
            dynload = os.path.join(stdlib, "lib-dynload")
            modules = sorted(os.path.join(dynload, f) for f in os.listdir(dynload)) if os.path.isdir(dynload) else []
            loader, libraries = _shared_libraries([executable, *modules])
            _RUNTIME = Runtime(executable, stdlib, loader, tuple(libraries))
        return _RUNTIME


def bwrap_path() -> str:
    """bubblewrap: $DARE_BWRAP if set, else `bwrap` on PATH or in /usr/bin."""
    path = os.environ.get("DARE_BWRAP") or shutil.which("bwrap") or "/usr/bin/bwrap"
    if not os.access(path, os.X_OK):
        raise SandboxUnavailable(f"the code sandbox needs bubblewrap ({path} not found): {INSTALL_HINT}")
    return path


def jail_command(rt: Runtime, limits: SandboxLimits, info_fd: int, seccomp_fd: int) -> tuple[list[str], list[str]]:
    """bubblewrap's options and the jailed command for one `_sandbox_child.py`: the options hold host
    paths, so the caller passes them through `--args FD` and they never appear on a command line
    the jail can read (`/proc/1/cmdline` is bubblewrap's)."""
    version = os.path.basename(rt.stdlib)  # python3.X
    stdlib = f"/py/lib/{version}"
    options = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session", "--clearenv", "--seccomp", str(seccomp_fd)]
    if os.geteuid() == 0:
        # no user namespace: the start-up code itself drops to an unprivileged uid of the host. A user
        # namespace here would map the jail to the host's root; the seccomp filter is what stops the
        # jail from creating namespaces of its own
        uid = gid = 1_000_000_000 + secrets.randbelow(1_000_000_000)
        options += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        uid = gid = 65534
        options += ["--unshare-user", "--uid", str(uid), "--gid", str(gid), "--disable-userns"]
    options += ["--ro-bind", rt.loader, rt.loader, "--ro-bind", rt.executable, "/py/bin/python3",
                "--ro-bind", rt.stdlib, stdlib]
    for library in rt.libraries:
        options += ["--ro-bind", library, f"/py/lib/{os.path.basename(library)}"]
    if os.path.isdir(os.path.join(rt.stdlib, "site-packages")):
        options += ["--tmpfs", f"{stdlib}/site-packages", "--remount-ro", f"{stdlib}/site-packages"]
    # bubblewrap makes the folders above the bound files 0700: open them to the unprivileged uid
    for folder in sorted({"/py", "/py/bin", "/py/lib", os.path.dirname(rt.loader)}):
        options += ["--chmod", "0755", folder]
    options += ["--dev", "/dev", "--proc", "/proc", "--size", str(limits.work_mb << 20), "--tmpfs", "/sandbox",
                "--chmod", "0777", "/sandbox", "--remount-ro", "/", "--chdir", "/sandbox", "--info-fd", str(info_fd)]
    env = {"PATH": "/py/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "LD_LIBRARY_PATH": "/py/lib", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
           "PYTHONDONTWRITEBYTECODE": "1", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for key, value in env.items():
        options += ["--setenv", key, value]
    return options, ["/py/bin/python3", "-I", "-S", "-B", "-c", CHILD_SOURCE, str(uid), str(gid)]


def jail_memory_bytes(limits: SandboxLimits) -> int:
    """The whole jail's memory (every process and its tmpfs) where a cgroup holds it."""
    return (limits.memory_mb + limits.work_mb) << 20


def jail_tasks(limits: SandboxLimits) -> int:
    # the candidate's processes and threads, plus bubblewrap's own (outer process, PID-namespace init)
    return limits.processes + 4


def rlimits(limits: SandboxLimits) -> dict:
    cpu = int(math.ceil(limits.cpu_s))
    return {"RLIMIT_CORE": (0, 0), "RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (limits.memory_mb << 20,) * 2,
            "RLIMIT_FSIZE": (limits.file_mb << 20,) * 2, "RLIMIT_NOFILE": (limits.open_files,) * 2,
            "RLIMIT_NPROC": (limits.processes,) * 2, "RLIMIT_MEMLOCK": (0, 0), "RLIMIT_MSGQUEUE": (0, 0)}


def memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, for bubblewrap to read from its start (no pipe
    buffer to overflow, nothing on disk)."""
    fd = os.memfd_create(name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
