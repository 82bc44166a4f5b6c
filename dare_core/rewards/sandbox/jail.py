"""The jail of the code sandbox: what it holds and bubblewrap's command line for it.

A jail holds its own copy of the interpreter, the parts of the standard library a run can use and
the shared libraries they load (`dare_core.rewards.sandbox.runtime`), all in bubblewrap's root tmpfs, which
is then made read-only; a private tmpfs at /sandbox; /dev's usual nodes; and a /proc of its own
processes whose machine-wide files are covered. Run by root, bubblewrap builds it without a user
namespace and the start-up code (`_sandbox_child.py`) drops to a random uid of the host with no
capabilities; run by another user, it is a user namespace mapping uid 65534 to that user. Either
way a seccomp filter (`dare_core.rewards.sandbox.seccomp`) closes keyrings, namespaces, mounts, tracing and
the kernel's shared state, and a cgroup per jail (`dare_core.rewards.sandbox.cgroup`) bounds its memory,
processes and CPU as a whole. `dare_core.rewards.sandbox` runs jails.
"""
from __future__ import annotations

import functools
import math
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from dare_core.rewards.sandbox.unavailable import INSTALL_HINT, SandboxUnavailable

if TYPE_CHECKING:
    from dare_core.rewards.sandbox.runtime import RuntimeFile, RuntimeImage

CHILD_SOURCE = Path(__file__).with_name("_sandbox_child.py").read_text()

@dataclass(frozen=True)
class SandboxLimits:
    # the run's time limit (both jails, every stdin/stdout case): the CPU time its jails spend together
    # where their cgroups count it (a jail waiting for a core is not charged), else wall clock
    wall_s: float = 10.0
    cpu_s: int = 10  # per process
    memory_mb: int = 1024  # address space per process; with a cgroup, also the jail's memory (+ work_mb)
    file_mb: int = 16  # largest file a process may write
    work_mb: int = 64  # size of the private tmpfs working directory
    open_files: int = 64
    processes: int = 16  # processes and threads of one jail's uid (and of the whole jail, with a cgroup)
    output_bytes: int = 64 * 1024  # kept per stream (and per stdin/stdout case)
    flood_bytes: int = 8 * 1024 * 1024  # more than this on stdout+stderr kills the jails
    backstop: float = 3.0  # where wall_s counts CPU time, the wall clock still ends a run at backstop * wall_s
    cpus: float = 1.0  # cores one jail may use at once, all its processes and threads together (cgroup quota)


def bwrap_path() -> str:
    """bubblewrap: $DARE_BWRAP if set, else `bwrap` on PATH or in /usr/bin."""
    path = os.environ.get("DARE_BWRAP") or shutil.which("bwrap") or "/usr/bin/bwrap"
    if not os.access(path, os.X_OK):
        raise SandboxUnavailable(f"the code sandbox needs bubblewrap ({path} not found): {INSTALL_HINT}")
    return path


# /proc entries of a task or of the jail's own namespaces; every other top-level entry is the
# machine's (meminfo, loadavg, stat, locks, pressure/, sys/, ...): counters that any jail moves and
# any other reads, so they are covered (files by /dev/null, folders by an empty tmpfs)
_PROC_KEPT = {"self", "thread-self", "net", "mounts"}


@functools.lru_cache(maxsize=1)
def _proc_covers() -> tuple[tuple[str, bool], ...]:
    """(name, is a folder) of the machine-wide entries of /proc, as this kernel has them."""
    covers = []
    for name in sorted(os.listdir("/proc")):
        path = os.path.join("/proc", name)
        if name.isdigit() or name in _PROC_KEPT or os.path.islink(path):
            continue
        covers.append((name, os.path.isdir(path)))
    return tuple(covers)


def jail_command(image: "RuntimeImage", copies: Sequence[tuple[int, "RuntimeFile"]], limits: SandboxLimits,
                 info_fd: int, seccomp_fd: int) -> tuple[list[str], list[str]]:
    """bubblewrap's options and the jailed command for one `_sandbox_child.py`. `copies` are this
    jail's descriptors of the runtime image (`runtime.open_for_jail`): bubblewrap copies each into
    its root tmpfs. The options go through `--args FD`, never on a command line the jail reads."""
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
    for folder in image.directories:  # made 0755 (bubblewrap would make the parents of a file 0700)
        options += ["--perms", "0755", "--dir", folder]
    for fd, file in copies:
        options += ["--perms", f"{file.mode:04o}", "--file", str(fd), file.path]
    options += ["--dev", "/dev", "--proc", "/proc"]
    for name, folder in _proc_covers():
        options += (["--perms", "0555", "--size", "4096", "--tmpfs", f"/proc/{name}"] if folder
                    else ["--ro-bind", "/dev/null", f"/proc/{name}"])
    options += ["--size", str(limits.work_mb << 20), "--tmpfs", "/sandbox", "--chmod", "0777", "/sandbox",
                "--remount-ro", "/", "--chdir", "/sandbox", "--info-fd", str(info_fd)]
    env = {"PATH": "/py/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "LD_LIBRARY_PATH": "/py/lib", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
           "PYTHONDONTWRITEBYTECODE": "1", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for key, value in env.items():
        options += ["--setenv", key, value]
    return options, ["/py/bin/python3", "-I", "-S", "-B", "-c", CHILD_SOURCE, str(uid), str(gid)]


def jail_memory_bytes(limits: SandboxLimits, image: "RuntimeImage") -> int:
    """The whole jail's memory where a cgroup holds it: every process, its work dir and the copy of
    the runtime it is given (which the candidate does not pay for)."""
    return ((limits.memory_mb + limits.work_mb) << 20) + image.bytes


def jail_processes(limits: SandboxLimits) -> int:
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
