"""The jail's seccomp filter: a classic-BPF program, assembled here, that bubblewrap installs
(`--seccomp FD`) on the jailed process before it executes anything.

It denies, with EPERM, the system calls that reach state shared with the host or other jails, create
namespaces (a nested user namespace would let a candidate mount its own tmpfs and regain
capabilities), mount, trace or read other processes, or open large kernel attack surfaces (bpf,
perf, io_uring, userfaultfd, modules, kexec). `clone3` gets ENOSYS, because its flags live in memory
that seccomp cannot read: libc then falls back to `clone`, whose flags it can. A system call of
another architecture (i386's `int 0x80`, x32's numbers) kills the process.

Shared state, the channels one jail could signal another through (docs/sandbox.md, "Nothing
shared"): kernel keyrings; file locks of every kind and change notification, because /dev's nodes
are the host's own inodes in every jail. Taking or releasing a lock (`flock`, `fcntl`'s record and
open-file-description locks) succeeds without doing anything, so that programs that lock their own
files (sqlite3) still run while no lock ever reaches the kernel; asking about locks (F_GETLK,
F_OFD_GETLK), leases and notification (inotify, fanotify, F_NOTIFY) fail with EPERM. Page-cache residency (`fadvise64`, `readahead`,
`mincore`, `cachestat`, `process_madvise`); machine-wide counters (`sysinfo`'s free memory and
process count, `ustat`'s free space of any mounted filesystem, another jail's tmpfs included, and
the machine's AIO budget through `io_setup`); and sockets of any family but AF_UNIX, AF_INET and
AF_INET6 (EAFNOSUPPORT), whose state is the jail's own network namespace: AF_VSOCK's ports, for one,
are the machine's.
"""
from __future__ import annotations

import platform
import struct
from typing import Optional, Union

from dare_core.rewards.sandbox.unavailable import SandboxUnavailable

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH = 0, 4
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_KILL_PROCESS, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_X32_BIT = 0x40000000
KEYCTL_JOIN_SESSION_KEYRING = 1
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
NAMESPACE_FLAGS = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# (audit arch, system call numbers); the names are the same on both, the numbers are not
_DENIED = ("add_key request_key setns mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig "
           "fsmount fspick mount_setattr ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd bpf "
           "perf_event_open userfaultfd kexec_load kexec_file_load init_module finit_module delete_module swapon "
           "swapoff reboot io_uring_setup io_uring_enter io_uring_register open_by_handle_at name_to_handle_at "
           "acct quotactl quotactl_fd syslog vhangup settimeofday clock_settime clock_adjtime adjtimex sethostname "
           "setdomainname fanotify_init move_pages migrate_pages inotify_init1 inotify_add_watch "
           "inotify_rm_watch fanotify_mark fadvise64 readahead mincore cachestat process_madvise sysinfo "
           "io_setup").split()
_X86_64_ONLY = {"iopl": 172, "ioperm": 173, "uselib": 134, "_sysctl": 156, "lookup_dcookie": 212, "inotify_init": 253,
                "ustat": 136}
# fcntl commands on state shared through an inode (the same numbers on both architectures): those
# that take or release a lock (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW) do nothing and return 0;
# those that read it or watch (F_GETLK, F_OFD_GETLK, F_SETLEASE, F_GETLEASE, F_NOTIFY) fail
LOCKING_COMMANDS = (6, 7, 37, 38)
QUERY_COMMANDS = (5, 36, 1024, 1025, 1026)
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
ARCHES = {
    "x86_64": (0xC000003E, {
        "keyctl": 250, "add_key": 248, "request_key": 249, "unshare": 272, "clone": 56, "clone3": 435,
        "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320,
        "init_module": 175, "finit_module": 313, "delete_module": 176, "swapon": 167, "swapoff": 168,
        "reboot": 169, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "personality": 135, "acct": 163, "quotactl": 179,
        "quotactl_fd": 443, "syslog": 103, "vhangup": 153, "settimeofday": 164, "clock_settime": 227,
        "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170, "setdomainname": 171, "fanotify_init": 300,
        "move_pages": 279, "migrate_pages": 256, "flock": 73, "inotify_init1": 294, "inotify_add_watch": 254,
        "inotify_rm_watch": 255, "fanotify_mark": 301, "fadvise64": 221, "readahead": 187, "mincore": 27,
        "cachestat": 451, "process_madvise": 440, "sysinfo": 99, "io_setup": 206, "fcntl": 72, "socket": 41,
        "socketpair": 53, **_X86_64_ONLY}),
    "aarch64": (0xC00000B7, {
        "keyctl": 219, "add_key": 217, "request_key": 218, "unshare": 97, "clone": 220, "clone3": 435,
        "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_getfd": 438,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "swapon": 224, "swapoff": 225,
        "reboot": 142, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "personality": 92, "acct": 89, "quotactl": 60,
        "quotactl_fd": 443, "syslog": 116, "vhangup": 58, "settimeofday": 170, "clock_settime": 112,
        "clock_adjtime": 266, "adjtimex": 171, "sethostname": 161, "setdomainname": 162, "fanotify_init": 262,
        "move_pages": 239, "migrate_pages": 238, "flock": 32, "inotify_init1": 26, "inotify_add_watch": 27,
        "inotify_rm_watch": 28, "fanotify_mark": 263, "fadvise64": 223, "readahead": 213, "mincore": 232,
        "cachestat": 451, "process_madvise": 440, "sysinfo": 179, "io_setup": 0, "fcntl": 25, "socket": 198,
        "socketpair": 199}),
}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}

Label = Union[int, str]


def machine() -> str:
    """This host's architecture as a key of ARCHES; SandboxUnavailable where there is no filter for it."""
    arch = platform.machine().lower()
    arch = _ALIASES.get(arch, arch)
    if arch not in ARCHES:
        raise SandboxUnavailable(f"the code sandbox has no seccomp filter for architecture {arch!r} "
                                 f"(supported: {', '.join(ARCHES)}); code is never run without it")
    return arch


def syscall_number(name: str, arch: Optional[str] = None) -> int:
    return ARCHES[arch or machine()][1][name]


def _arg(index: int, high: bool = False) -> int:
    # offset of the low (or high) 32 bits of args[index]; both supported arches are little-endian
    return 16 + 8 * index + (4 if high else 0)


def _assemble(program: list) -> bytes:
    """Pack (code, jt, jf, k) instructions; jt/jf may name a label (a str entry of `program`),
    resolved to the forward offset classic BPF wants."""
    labels, instructions = {}, []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(instructions)
        else:
            instructions.append(item)
    packed = []
    for index, (code, jt, jf, k) in enumerate(instructions):
        offsets = []
        for target in (jt, jf):
            offset = labels[target] - index - 1 if isinstance(target, str) else target
            if not 0 <= offset <= 255:
                raise ValueError(f"BPF jump out of range at {index}: {offset}")
            offsets.append(offset)
        packed.append(struct.pack("=HBBI", code, offsets[0], offsets[1], k & 0xFFFFFFFF))
    if len(packed) > 4096:
        raise ValueError("BPF program too long")
    return b"".join(packed)


def _prologue(audit_arch: int) -> list:
    return [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, audit_arch), (_RET, 0, 0, _KILL_PROCESS),
            (_LD_W_ABS, 0, 0, _NR), (_JGE, "kill", 0, _X32_BIT)]


def jail_filter(arch: Optional[str] = None, allow_join_session_keyring: bool = True) -> bytes:
    """The filter bubblewrap installs. With `allow_join_session_keyring`, one keyctl call stays open,
    `keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)`: the start-up code uses it to leave the trainer's
    keyring for a new empty one, then closes keyctl entirely with `keyctl_seal_filter`."""
    audit_arch, numbers = ARCHES[arch or machine()]
    program = _prologue(audit_arch)
    for name in _DENIED + sorted(set(numbers) & set(_X86_64_ONLY)):
        program.append((_JEQ, "eperm", 0, numbers[name]))
    program += [(_JEQ, "enosys", 0, numbers["clone3"]), (_JEQ, "flags", 0, numbers["clone"]),
                (_JEQ, "flags", 0, numbers["unshare"]), (_JEQ, "personality", 0, numbers["personality"]),
                (_JEQ, "keyctl", 0, numbers["keyctl"]), (_JEQ, "noop", 0, numbers["flock"]),
                (_JEQ, "fcntl", 0, numbers["fcntl"]),
                (_JEQ, "family", 0, numbers["socket"]), (_JEQ, "family", 0, numbers["socketpair"]),
                (_RET, 0, 0, _ALLOW),
                # clone/unshare: no namespace flag in the low word of the flags (the high word holds none)
                "flags", (_LD_W_ABS, 0, 0, _arg(0)), (_JSET, "eperm", 0, NAMESPACE_FLAGS), (_RET, 0, 0, _ALLOW),
                # personality: only the query and the default; other personas change the kernel's ABI
                "personality", (_LD_W_ABS, 0, 0, _arg(0)), (_JEQ, "allow", 0, 0),
                (_JEQ, "allow", "eperm", 0xFFFFFFFF),
                # fcntl: the command is an unsigned int, the low word of args[1]
                "fcntl", (_LD_W_ABS, 0, 0, _arg(1))]
    program += [(_JEQ, "noop", 0, command) for command in LOCKING_COMMANDS]
    program += [(_JEQ, "eperm", 0, command) for command in QUERY_COMMANDS] + [(_RET, 0, 0, _ALLOW)]
    # socket/socketpair: the family is an int, the low word of args[0]
    program += ["family", (_LD_W_ABS, 0, 0, _arg(0))]
    program += [(_JEQ, "allow", 0, family) for family in SOCKET_FAMILIES] + [(_RET, 0, 0, _ERRNO | _EAFNOSUPPORT)]
    program += ["keyctl"]
    if allow_join_session_keyring:
        program += [(_LD_W_ABS, 0, 0, _arg(0)), (_JEQ, 0, "eperm", KEYCTL_JOIN_SESSION_KEYRING),
                    (_LD_W_ABS, 0, 0, _arg(0, high=True)), (_JEQ, 0, "eperm", 0),
                    (_LD_W_ABS, 0, 0, _arg(1)), (_JEQ, 0, "eperm", 0),
                    (_LD_W_ABS, 0, 0, _arg(1, high=True)), (_JEQ, "allow", "eperm", 0)]
    # errno 0: the call is skipped and returns 0
    program += ["eperm", (_RET, 0, 0, _ERRNO | _EPERM), "noop", (_RET, 0, 0, _ERRNO | 0), "allow", (_RET, 0, 0, _ALLOW),
                "enosys", (_RET, 0, 0, _ERRNO | _ENOSYS), "kill", (_RET, 0, 0, _KILL_PROCESS)]
    return _assemble(program)


def keyctl_seal_filter(arch: Optional[str] = None) -> bytes:
    """A second filter, stacked by the start-up code once it has joined its fresh keyring: keyctl
    then fails for good (stacked filters: the strictest verdict wins)."""
    audit_arch, numbers = ARCHES[arch or machine()]
    return _assemble(_prologue(audit_arch) + [(_JEQ, 0, "allow", numbers["keyctl"]), (_RET, 0, 0, _ERRNO | _EPERM),
                                              "allow", (_RET, 0, 0, _ALLOW), "kill", (_RET, 0, 0, _KILL_PROCESS)])
