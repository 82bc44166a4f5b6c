"""What one jail shares with the host and with other jails: nothing. Kernel keyrings, namespaces,
mounts and tracing are closed by seccomp; memory and processes are bounded for the jail as a whole
by its cgroup; no process of a jail outlives its call; /proc shows no path of the trainer's."""
import ctypes
import json
import os
import secrets
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from dare_core.rewards.sandbox import cgroup, seccomp
from dare_core.rewards.sandbox import SandboxLimits, run_python
from dare_core.rewards.scoring import score_texts

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=4, memory_mb=256)
EPERM, ENOSYS = 1, 38
# ctypes helpers of the candidate's programs: every call returns (result, errno)
SYSCALL = ("import ctypes, os, json\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
           "def call(nr, *args):\n    ctypes.set_errno(0)\n"
           "    r = libc.syscall(ctypes.c_long(nr), *[a if isinstance(a, bytes) else ctypes.c_long(a) for a in args])\n"
           "    return [r, ctypes.get_errno()]\n")


def nr(name: str) -> int:
    return seccomp.syscall_number(name)


def stdout_of(program: str, **limits) -> str:
    result = run_python(program, inputs=[""], limits=SandboxLimits(**{**LIMITS.__dict__, **limits}))
    assert result.passed, (result.status, result.error, result.stderr)
    return result.cases[0]["stdout"]


def _running_in(namespaces: set[str]) -> list[int]:
    """Running (not zombie) processes of the given PID namespaces. A jail cannot make a PID
    namespace of its own (seccomp), so its processes are exactly those of its namespace."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") in namespaces:
                    with open(f"/proc/{entry}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(entry))
            except OSError:
                pass
    return found


# ---- kernel keyrings ------------------------------------------------------------------------------

class _Keys:
    """The test process's own keyctl/add_key, through libc's syscall()."""

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long

    def keyctl(self, *args) -> int:
        result = self.libc.syscall(ctypes.c_long(nr("keyctl")), *[a if isinstance(a, (bytes, ctypes.Array)) else ctypes.c_long(a) for a in args])
        if result < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return result

    def add(self, description: bytes, payload: bytes) -> int:
        result = self.libc.syscall(ctypes.c_long(nr("add_key")), b"user", description, payload,
                                   ctypes.c_long(len(payload)), ctypes.c_long(-3))  # KEY_SPEC_SESSION_KEYRING
        if result < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return result

    def read(self, key: int) -> bytes:
        buffer = ctypes.create_string_buffer(4096)
        size = self.keyctl(11, key, buffer, 4096)  # KEYCTL_READ
        return buffer.raw[:size]


def test_the_trainers_keyring_is_out_of_reach_and_nothing_is_left_behind():
    keys = _Keys()
    try:
        key = keys.add(b"dare-planted-" + secrets.token_hex(4).encode(), b"hunter2")
    except OSError as exc:
        pytest.skip(f"no kernel keyrings here: {exc}")
    try:
        session = keys.keyctl(0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
        before = keys.read(session)
        # each attempt returns its errno: 1 (EPERM) for every one is the only passing answer
        program = SYSCALL + (
            f"def attack():\n    found = []\n    buf = ctypes.create_string_buffer(256)\n"
            f"    found.append(call({nr('keyctl')}, 11, {key}, ctypes.addressof(buf), 256)[1])  # read the secret\n"
            f"    found.append(call({nr('keyctl')}, 2, {key}, b'pwned', 5)[1])  # overwrite it\n"
            f"    found.append(call({nr('keyctl')}, 0, -3, 0)[1])  # name the session keyring\n"
            f"    found.append(call({nr('keyctl')}, 1, b'dare-shared')[1])  # join a named keyring\n"
            f"    found.append(call({nr('keyctl')}, 1, 0)[1])  # a new one, which the start-up code did already\n"
            f"    for i in range(20):  # keys left behind for the next rollout\n"
            f"        found.append(call({nr('add_key')}, b'user', b'memo%d' % i, b'x', 1, -3)[1])\n"
            f"    found.append(call({nr('request_key')}, b'user', b'dare-planted', 0, 0)[1])\n"
            f"    try:\n        found.append('dare-planted' in open('/proc/keys').read())\n"
            f"    except OSError:\n        found.append(False)\n    return found\n")
        tests = "assert attack() == [1] * 26 + [False]\n"
        [result] = score_texts([{"reward": "code", "ground_truth": tests}], [f"```python\n{program}```"])
        assert result.score == 1.0, result.extra
        assert keys.read(key) == b"hunter2"
        assert keys.read(session) == before  # no key added to, or removed from, the trainer's keyring
    finally:
        keys.keyctl(21, key)  # KEYCTL_INVALIDATE


# ---- seccomp: namespaces, mounts, tracing ---------------------------------------------------------

def test_seccomp_denies_namespaces_mounts_tracing_and_kernel_surfaces():
    attempts = {
        "unshare_user": (nr("unshare"), 0x10000000), "unshare_mount": (nr("unshare"), 0x20000),
        "unshare_net": (nr("unshare"), 0x40000000), "unshare_pid": (nr("unshare"), 0x20000000),
        "clone_user": (nr("clone"), 0x10000000 | 17), "clone3": (nr("clone3"), 0, 0),
        "setns": (nr("setns"), 0, 0), "mount": (nr("mount"), b"none", b"/sandbox", b"tmpfs", 0, 0),
        "umount2": (nr("umount2"), b"/proc", 2), "pivot_root": (nr("pivot_root"), b"/sandbox", b"/sandbox"),
        "ptrace": (nr("ptrace"), 0, 0, 0, 0), "process_vm_readv": (nr("process_vm_readv"), 1, 0, 0, 0, 0, 0),
        "bpf": (nr("bpf"), 0, 0, 0), "perf_event_open": (nr("perf_event_open"), 0, 0, -1, -1, 0),
        "userfaultfd": (nr("userfaultfd"), 0), "io_uring_setup": (nr("io_uring_setup"), 1, 0),
        "personality": (nr("personality"), 0x0040000), "keyctl": (nr("keyctl"), 0, -3, 0),
        "open_by_handle_at": (nr("open_by_handle_at"), 0, 0, 0),
    }
    program = SYSCALL + (
        f"out = {{}}\nfor name, (number, *args) in {attempts!r}.items():\n"
        f"    result, errno = call(number, *args)\n    if result == 0 and name.startswith('clone'):\n"
        f"        os._exit(0)  # a child that should never have been\n"
        f"    out[name] = errno if result == -1 else 'allowed'\n"
        # what ordinary programs need still works: fork (clone), threads, a subprocess-free pipe
        f"pid = os.fork()\nif pid == 0:\n    os._exit(7)\nout['fork'] = os.waitpid(pid, 0)[1] >> 8\n"
        f"import threading\nt = threading.Thread(target=lambda: out.setdefault('thread', 1))\nt.start()\nt.join()\n"
        f"out['personality_query'] = call({nr('personality')}, 0xffffffff)[0] >= 0\nprint(json.dumps(out))\n")
    out = json.loads(stdout_of(program))
    expected = {name: (ENOSYS if name == "clone3" else EPERM) for name in attempts}
    assert out == {**expected, "fork": 7, "thread": 1, "personality_query": True}


def test_a_nested_namespace_cannot_mount_its_own_tmpfs():
    # the red team's escape from the work-dir limit: a user+mount namespace, then a tmpfs of its own
    program = SYSCALL + (
        f"u = call({nr('unshare')}, 0x10000000 | 0x20000)\n"
        f"os.makedirs('/sandbox/mnt', exist_ok=True)\n"
        f"m = call({nr('mount')}, b'none', b'/sandbox/mnt', b'tmpfs', 0, b'size=2g')\n"
        f"written = 0\ntry:\n    with open('/sandbox/mnt/big', 'wb') as f:\n        for _ in range(256):\n"
        f"            f.write(b'x' * (1 << 20))\n            written += 1\nexcept OSError:\n    pass\n"
        f"print(json.dumps([u, m, written]))\n")
    unshared, mounted, written_mb = json.loads(stdout_of(program))
    assert unshared == [-1, EPERM] and mounted == [-1, EPERM]
    assert written_mb < 64  # it wrote into the jail's own 64 MB /sandbox, nothing more


def test_architecture_mismatch_kills_and_unknown_architectures_refuse():
    # x32's numbers (a different ABI through the same entry) end the process, not the filter
    result = run_python(SYSCALL + "call(0x40000000 + 39)\nprint('survived')\n", inputs=[""], limits=LIMITS)
    assert result.status == "crashed" and "SIGSYS" in result.error
    assert seccomp.jail_filter("aarch64") != seccomp.jail_filter("x86_64")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(seccomp.platform, "machine", lambda: "riscv64")
        with pytest.raises(seccomp.SandboxUnavailable, match="riscv64"):
            run_python("print(1)", inputs=[""], limits=LIMITS)


# ---- the jail as a whole: memory, processes -------------------------------------------------------

needs_cgroup = pytest.mark.skipif(not cgroup._layout(), reason="no cgroup can be made here: rlimits only")


@needs_cgroup
def test_memory_of_a_forking_program_is_bounded_as_a_whole():
    # four processes of 300 MB each: within the 512 MB per-process address space, not within the
    # jail's 512 + 64 MB together. Each marks /sandbox once it holds its memory, then waits for the others
    program = ("import os, time\nfor i in range(3):\n    if os.fork() == 0:\n        break\nelse:\n    i = 3\n"
               "held = b'x' * (300 << 20)\nopen('/sandbox/held%d' % i, 'w').close()\n"
               "deadline = time.monotonic() + 3\n"
               "while len([n for n in os.listdir('/sandbox') if n.startswith('held')]) < 4 and time.monotonic() < deadline:\n"
               "    time.sleep(0.05)\n"
               "if i == 3:\n    print(len([n for n in os.listdir('/sandbox') if n.startswith('held')]))\n"
               "else:\n    os._exit(0)\n")
    limits = SandboxLimits(**{**LIMITS.__dict__, "memory_mb": 512, "wall_s": 8.0})
    result = run_python(program, inputs=[""], limits=limits)
    assert not (result.passed and result.cases[0]["stdout"] == "4\n"), "four processes held 1.2 GB at once"
    assert result.status in ("passed", "crashed", "timeout")
    # one process of 300 MB fits the same budget, so the limit is the jail's, not a smaller one
    assert stdout_of("x = b'x' * (300 << 20)\nprint(len(x) >> 20)", memory_mb=512) == "300\n"


def test_no_process_outlives_its_call_under_load():
    # forks, a setsid daemon, a double fork; the first process returns at once
    program = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
               "        if os.fork() == 0:\n            if os.fork() == 0:\n                time.sleep(60)\n"
               "            os._exit(0)\n        time.sleep(60)\n        os._exit(0)\nprint('detached')\n")
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: run_python(program, inputs=[""], limits=LIMITS), range(16)))
    # at once: no grace period after the calls returned
    left = _running_in({f"pid:[{info['pid-namespace']}]" for r in results for info in r.jails})
    assert all(r.status == "passed" and r.cases[0]["stdout"] == "detached\n" for r in results)
    assert not left, f"{len(left)} jailed processes outlived their calls"
    assert not [n for n in _group_dirs() if n.startswith(f"dare-jail-{os.getpid()}-")], "a jail's cgroup was left"


def _group_dirs() -> list[str]:
    layout = cgroup._layout()
    return [n for d in layout.values() for n in os.listdir(d)]


# ---- what /proc shows -----------------------------------------------------------------------------

def test_proc_shows_no_path_of_the_trainer(tmp_path):
    program = ("import json\nviews = {}\nfor path in ('/proc/1/cmdline', '/proc/self/cmdline', '/proc/self/environ',\n"
               "             '/proc/1/environ', '/proc/self/cgroup', '/proc/self/mountinfo'):\n"
               "    try:\n        views[path] = open(path, 'rb').read().decode('utf-8', 'replace')\n"
               "    except OSError as exc:\n        views[path] = type(exc).__name__\nprint(json.dumps(views))\n")
    views = json.loads(stdout_of(program))
    secrets_of_host = [os.getcwd(), sys.prefix, str(tmp_path), os.path.dirname(os.path.abspath(__file__))]
    for path, text in views.items():
        for host_path in secrets_of_host:
            assert host_path not in text, (path, host_path)
    # bubblewrap's own command line (with every bound host path) is not on it: the options came by fd
    assert "--ro-bind" not in views["/proc/1/cmdline"] and "--args" in views["/proc/1/cmdline"]
    assert all(line.endswith(":/") for line in views["/proc/self/cgroup"].split())  # its own cgroup namespace
    assert "PATH=/py/bin" in views["/proc/self/environ"] or views["/proc/self/environ"] == "PermissionError"


def test_without_a_cgroup_the_jail_falls_back_to_rlimits_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cgroup, "_detect", lambda: {})
    monkeypatch.setattr(cgroup, "_LAYOUT", None)
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('ok')\n"
    with caplog.at_level("WARNING", logger=cgroup.__name__):
        results = [run_python(program, inputs=[""], limits=LIMITS) for _ in range(2)]
    assert [r.cases[0]["stdout"] for r in results] == ["ok\n", "ok\n"]
    assert len([r for r in caplog.records if "no cgroup" in r.getMessage()]) == 1
    # the PID namespace's init is waited for, so even here nothing of the jail is left running
    assert not _running_in({f"pid:[{info['pid-namespace']}]" for r in results for info in r.jails})
