"""Rows scored together share nothing, and no row takes another's CPU (docs/sandbox.md, "Nothing
shared" and "CPU"). Each test is an attack as a hostile policy would write it, through `score_texts`:
row A sets a bit (a file lock, file accesses, a page-cache eviction, a vsock port, busy cores) and
row B, scored in the same call or in the next one, tries to read it back. B scores 1 only when it
saw nothing; the honest row beside a CPU hog still scores 1."""
import json
import os
import secrets
import sys
import sysconfig

import pytest

from dare_core.rewards.sandbox import cgroup
from dare_core.rewards.sandbox import check_available
from dare_core.rewards.scoring import score_texts

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

# the files every jail reads: its interpreter, an extension module, and /dev/null (the host's node)
TARGETS = "import sys, math\nTARGETS = [sys.executable, math.__file__, '/dev/null']\n"
NOTHING_SEEN = "assert probe() == []\n"


def _row(ground_truth: str, timeout: float = 10.0) -> dict:
    return {"reward": "code", "ground_truth": ground_truth, "reward_args": json.dumps({"timeout": timeout})}


def _score(*pairs: tuple[str, str]) -> list:
    """Score (program, tests) pairs in one call, all at once."""
    rows = [_row(tests) for _, tests in pairs]
    return score_texts(rows, [f"```python\n{program}```" for program, _ in pairs], workers=len(pairs))


def _saw_nothing(result) -> None:
    assert result.score == 1.0, result.extra


# ---- file locks --------------------------------------------------------------------------------

HOLD_LOCKS = TARGETS + (
    "import fcntl, os, struct, time\n"
    "def hold():\n    held = []\n    for path in TARGETS:\n        fd = os.open(path, os.O_RDONLY)\n"
    "        for name, take in (('flock', lambda: fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)),\n"
    "                           ('posix', lambda: fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack('hhqqi4x', fcntl.F_RDLCK, 0, 0, 1, 0))),\n"
    "                           ('ofd', lambda: fcntl.fcntl(fd, 37, struct.pack('hhqqi4x', fcntl.F_RDLCK, 0, 1, 1, 0)))):\n"
    "            try:\n                take()\n                held.append(name)\n            except OSError:\n                pass\n"
    "    time.sleep(1.5)\n    return held\n")
PROBE_LOCKS = TARGETS + (
    "import fcntl, os, struct, time\n"
    "def probe():\n    seen, end = set(), time.monotonic() + 1.2\n    fds = [os.open(p, os.O_RDONLY) for p in TARGETS]\n"
    "    while time.monotonic() < end and not seen:\n        for path, fd in zip(TARGETS, fds):\n"
    "            try:\n                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n                fcntl.flock(fd, fcntl.LOCK_UN)\n"
    "            except BlockingIOError:\n                seen.add(('flock', path))\n            except OSError:\n                pass\n"
    "            for name, command, start in (('posix', fcntl.F_GETLK, 0), ('ofd', 36, 1)):\n"
    "                try:\n                    got = fcntl.fcntl(fd, command, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, start, 1, 0))\n"
    "                    if struct.unpack('hhqqi4x', got)[0] != fcntl.F_UNLCK:\n                        seen.add((name, path))\n"
    "                except OSError:\n                    pass\n        time.sleep(0.05)\n    return sorted(seen)\n")


def test_a_file_lock_taken_by_one_row_is_invisible_to_another():
    # every kind of lock (flock, a POSIX record lock, an open-file-description lock), on the
    # interpreter, an extension module and /dev/null: B tries to take or test a conflicting one
    _, probe = _score((HOLD_LOCKS, "assert hold() is not None\n"), (PROBE_LOCKS, NOTHING_SEEN))
    _saw_nothing(probe)


# ---- change notification -----------------------------------------------------------------------

TOUCH_FILES = TARGETS + (
    "import os, time\n"
    "def touch():\n    end = time.monotonic() + 1.5\n    while time.monotonic() < end:\n        for path in TARGETS:\n"
    "            fd = os.open(path, os.O_RDONLY)\n            os.read(fd, 1)\n            os.close(fd)\n"
    "        time.sleep(0.01)\n    return True\n")
PROBE_NOTIFY = TARGETS + (
    "import ctypes, os, select, time\n"
    "def probe():\n    libc = ctypes.CDLL(None, use_errno=True)\n    fd = libc.inotify_init1(os.O_NONBLOCK)\n"
    "    if fd < 0:\n        return []\n"
    "    watched = [p for p in TARGETS + [os.path.dirname(TARGETS[1])] if libc.inotify_add_watch(fd, p.encode(), 0x1 | 0x20) >= 0]\n"
    "    events, end = 0, time.monotonic() + 1.2\n    while time.monotonic() < end and not events:\n"
    "        if select.select([fd], [], [], 0.1)[0]:\n            events += len(os.read(fd, 4096))\n"
    "    return ['inotify'] if events else []\n")


def test_files_another_row_opens_raise_no_notification():
    _, probe = _score((TOUCH_FILES, "assert touch()\n"), (PROBE_NOTIFY, NOTHING_SEEN))
    _saw_nothing(probe)


# ---- page-cache residency ------------------------------------------------------------------------

# extension modules that neither the start-up code nor these programs import, the rarely used first
# (other processes of the host may map the others, and a mapped page cannot be evicted)
RESIDENCY_CANDIDATES = ("audioop", "syslog", "_md5", "_sha1", "_sha3", "_sha256", "_lsprof", "_statistics", "termios",
                        "_uuid", "_zoneinfo", "_csv", "_codecs_kr", "_codecs_tw", "_codecs_hk", "_opcode", "grp")


def _resident(path: str) -> bool:
    """Whether the first page of `path` is in the page cache, asked without reading it: mincore of a
    mapping never touched (true for the file's owner, root here; to anyone else the kernel answers
    "resident" for every page, which only makes the test skip)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        vector = ctypes.create_string_buffer(1)
        try:
            return libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(4096), vector) != 0 or bool(vector.raw[0] & 1)
        finally:
            libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(4096))
    finally:
        os.close(fd)


def _host_residency_setup() -> list[str]:
    """Four extension modules whose pages the host can evict (no process maps them): X, Y left out
    of the page cache, Z, W read into it. On an inode shared with the host, what A does shows."""
    check_available()  # the process's first jail reads every runtime file (ldd, the image): not after this
    dynload = os.path.join(sysconfig.get_path("stdlib"), "lib-dynload")
    chosen = []
    for name in RESIDENCY_CANDIDATES:
        path = next((os.path.join(dynload, f) for f in os.listdir(dynload) if f.startswith(name + ".")), None)
        if path is None:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not _resident(path):
                if len(chosen) >= 2:  # Z, W: back in
                    os.pread(fd, 1 << 22, 0)
                chosen.append(name)
        finally:
            os.close(fd)
        if len(chosen) == 4:
            return chosen
    pytest.skip("fewer than four extension modules whose pages can be evicted here")


def _residency(names: list[str]) -> tuple[str, str]:
    """(A's program, B's program) on the modules X, Y, Z, W of `names`."""
    common = ("import importlib.machinery, os, time\n"
              f"X, Y, Z, W = [importlib.machinery.PathFinder.find_spec(m).origin for m in {names!r}]\n")
    # A warms X (reads it) and evicts Z (fadvise): on a shared inode, one bit each
    act = common + ("def act(hold):\n    with open(X, 'rb') as f:\n        f.read()\n    fd = os.open(Z, os.O_RDONLY)\n"
                    "    try:\n        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n    except OSError:\n        pass\n"
                    "    time.sleep(hold)\n    return True\n")
    # B asks the kernel whether a file's first page is cached with a read that may not wait, after
    # giving A the time to act: X must look like Y, and Z like W, whatever A did. (mincore is no
    # oracle here: for a file the caller cannot write, the kernel reports every page as cached.) Such
    # a read starts reading the file in, so each test probes its files once
    probe = common + (
        "def state(path):\n    fd = os.open(path, os.O_RDONLY)\n    try:\n        os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)\n"
        "        return 'cached'\n    except BlockingIOError:\n        return 'not cached'\n    except OSError:\n"
        "        return 'unknown'\n    finally:\n        os.close(fd)\n"
        "def probe(delay):\n    time.sleep(delay)\n    x, y, z, w = map(state, (X, Y, Z, W))\n"
        "    return [] if (x, z) == (y, w) else [('X', x, 'Y', y), ('Z', z, 'W', w)]\n")
    return act, probe


def test_page_cache_residency_carries_nothing_between_rows_of_a_call():
    act, probe = _residency(_host_residency_setup())
    _, seen = _score((act, "assert act(1.5)\n"), (probe, "assert probe(0.7) == []\n"))
    _saw_nothing(seen)


def test_page_cache_residency_carries_nothing_to_the_next_call():
    act, probe = _residency(_host_residency_setup())
    _score((act, "assert act(0)\n"))
    [seen] = _score((probe, "assert probe(0) == []\n"))
    _saw_nothing(seen)


# ---- sockets whose state is the machine's ---------------------------------------------------------

def test_a_vsock_port_bound_by_one_row_is_invisible_to_another():
    port = 40000 + secrets.randbelow(20000)
    bind = (f"import socket, time\ndef bind():\n    try:\n        s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\n"
            f"        s.bind((socket.VMADDR_CID_ANY, {port}))\n        s.listen(1)\n    except OSError:\n        pass\n"
            f"    time.sleep(1.5)\n    return True\n")
    probe = (f"import errno, socket, time\ndef probe():\n    end = time.monotonic() + 1.2\n    while time.monotonic() < end:\n"
             f"        try:\n            s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\n        except OSError:\n"
             f"            return []\n        try:\n            s.bind((socket.VMADDR_CID_ANY, {port}))\n"
             f"        except OSError as exc:\n            if exc.errno == errno.EADDRINUSE:\n                return ['vsock']\n"
             f"        finally:\n            s.close()\n        time.sleep(0.05)\n    return []\n")
    _, seen = _score((bind, "assert bind()\n"), (probe, NOTHING_SEEN))
    _saw_nothing(seen)


# ---- machine-wide counters and host paths -----------------------------------------------------------

def test_machine_wide_counters_are_out_of_reach():
    # free memory, load, CPU time, every lock of the machine, open files, pressure: one row moves
    # them (allocates, spins, locks), another reads them. None can be read at all
    program = ("import ctypes\ndef probe():\n    seen = []\n"
               "    for path in ('/proc/meminfo', '/proc/loadavg', '/proc/stat', '/proc/locks', '/proc/vmstat',\n"
               "                 '/proc/sys/fs/file-nr', '/proc/pressure/memory', '/proc/self/../meminfo'):\n"
               "        try:\n            if open(path).read():\n                seen.append(path)\n        except OSError:\n"
               "            pass\n    info = ctypes.create_string_buffer(256)\n"
               "    if ctypes.CDLL(None).sysinfo(info) == 0:\n        seen.append('sysinfo')\n    return seen\n")
    [result] = _score((program, NOTHING_SEEN))
    _saw_nothing(result)


def test_no_host_path_shows_in_the_jails_mounts_or_maps():
    host = {os.path.realpath(sysconfig.get_path("stdlib")), os.path.dirname(os.path.realpath(sys._base_executable)),
            os.path.realpath(sysconfig.get_config_var("LIBDIR") or "/nonexistent"), "/lib/x86_64-linux-gnu",
            "/usr/lib", "/lib/aarch64-linux-gnu", sys.prefix, os.getcwd()}
    program = ("import math, json\ndef views():\n    found = {}\n"
               "    for path in ('/proc/self/mountinfo', '/proc/1/mountinfo', '/proc/self/mounts', '/proc/self/maps'):\n"
               "        try:\n            found[path] = open(path).read()\n        except OSError as exc:\n"
               "            found[path] = type(exc).__name__\n    return json.dumps(found)\n")
    tests = (f"import json\nseen = json.loads(views())\nassert len(seen['/proc/self/maps']) > 1000\n"
             f"for path, text in seen.items():\n    for host in {sorted(host)!r}:\n"
             f"        assert host + '/' not in text, (path, host)\n")
    [result] = _score((program, tests))
    assert result.score == 1.0, result.extra


# ---- CPU ---------------------------------------------------------------------------------------------

def _cpu_group_or_skip(quota: bool) -> None:
    """Skip where a jail's group cannot count its CPU time (or, with `quota`, cannot be given a quota)."""
    group = cgroup.JailGroup.create(64 << 20, 4, 0.5)
    try:
        if group is None or group.cpu_seconds() is None or (quota and group.cpus is None):
            pytest.skip("no cgroup here that counts (and limits) a jail's CPU time")
    finally:
        if group is not None:
            group.remove()


# sixteen busy processes in sessions of their own: before each jail had a CPU group, they took 16/17
# of a shared core from an honest row scored in the same call
HOG = ("import os\nfor _ in range(15):\n    if os.fork() == 0:\n        os.setsid()\n        break\n"
       "while True:\n    pass\ndef f():\n    return 1\n")
# about 0.3 s of CPU here; 2 * N for N a multiple of 7 (i*i % 7 sums to 14 over each 7)
N = 3_500_000
HONEST = f"def solve():\n    s = 0\n    for i in range({N}):\n        s += i * i % 7\n    return s\n"


def test_a_cpu_hog_does_not_starve_an_honest_row_of_the_same_call():
    _cpu_group_or_skip(quota=False)
    # both rows on one core, as a trainer rank pinned to its core would run them
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(affinity)})
    try:
        rows = [_row("assert f() == 1\n", timeout=2.0), _row(f"assert solve() == {2 * N}\n", timeout=2.0)]
        hog, honest = score_texts(rows, [f"```python\n{HOG}```", f"```python\n{HONEST}```"], workers=2)
    finally:
        os.sched_setaffinity(0, affinity)
    assert honest.score == 1.0, honest.extra
    # the hog ran out of its own CPU time, and says so
    assert hog.extra["failure"] == "timeout" and "CPU time limit 2 s" in hog.extra["error"], hog.extra


def test_a_jail_uses_no_more_than_its_cores_however_many_processes_it_makes():
    from dare_core.rewards.sandbox import SandboxLimits, run_python

    _cpu_group_or_skip(quota=True)

    program = ("import os, threading, time\nchild = False\nfor _ in range(3):\n    if os.fork() == 0:\n"
               "        os.setsid()\n        child = True\n        break\n"
               "def spin():\n    end = time.monotonic() + 1.5\n    while time.monotonic() < end:\n        pass\n"
               "thread = threading.Thread(target=spin)\nthread.start()\nspin()\nthread.join()\nif child:\n    os._exit(0)\n")
    result = run_python(program, inputs=[""], limits=SandboxLimits(wall_s=10, cpus=0.5))
    assert result.passed, (result.status, result.error)
    assert result.cpu_s <= 0.5 * result.wall_s + 0.2, (result.cpu_s, result.wall_s)


# ---- what is left of these kernel interfaces -------------------------------------------------------

def test_the_kernels_shared_state_is_closed_at_the_system_call():
    from dare_core.rewards.sandbox import seccomp
    from dare_core.rewards.sandbox import SandboxLimits, run_python

    nr = seccomp.syscall_number
    calls = {"inotify_init1": (nr("inotify_init1"), 0), "fanotify_mark": (nr("fanotify_mark"), 0, 0, 0, 0, 0),
             "fadvise64": (nr("fadvise64"), 0, 0, 0, 4), "readahead": (nr("readahead"), 0, 0, 4096),
             "mincore": (nr("mincore"), 0, 4096, 0), "cachestat": (nr("cachestat"), 0, 0, 0, 0),
             "process_madvise": (nr("process_madvise"), 0, 0, 0, 0, 0), "sysinfo": (nr("sysinfo"), 0),
             "io_setup": (nr("io_setup"), 1, 0), "fcntl_getlk": (nr("fcntl"), 0, 5, 0),
             "fcntl_notify": (nr("fcntl"), 0, 1026, 0), "vsock": (nr("socket"), 40, 1, 0),
             "netlink": (nr("socket"), 16, 3, 0), "packet": (nr("socket"), 17, 3, 0)}
    program = ("import ctypes, json\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
               f"out = {{}}\nfor name, (number, *args) in {calls!r}.items():\n    ctypes.set_errno(0)\n"
               "    result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])\n"
               "    out[name] = ctypes.get_errno() if result == -1 else 'allowed'\n"
               # taking a lock returns at once and locks nothing; sockets of the jail's own kinds work
               "import fcntl, os, socket\nfd = os.open('/dev/null', os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
               "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nout['socketpair'] = socket.socketpair()[0].family\n"
               "out['inet'] = socket.socket().family\nprint(json.dumps(out))\n")
    result = run_python(program, inputs=[""], limits=SandboxLimits(wall_s=10))
    assert result.passed, (result.status, result.error)
    out = json.loads(result.cases[0]["stdout"])
    eperm, eafnosupport = 1, 97
    sockets = {"vsock", "netlink", "packet"}
    assert out == {**{name: eafnosupport if name in sockets else eperm for name in calls}, "socketpair": 1, "inet": 2}


def test_programs_that_lock_their_own_files_still_run():
    # sqlite3 locks its database file: the lock is not taken, and the program works
    program = ("import sqlite3\ndef count():\n    db = sqlite3.connect('/sandbox/rows.db')\n"
               "    db.execute('create table t (x)')\n    db.executemany('insert into t values (?)', [(1,), (2,)])\n"
               "    db.commit()\n    return db.execute('select count(*) from t').fetchone()[0]\n")
    [result] = _score((program, "assert count() == 2\n"))
    assert result.score == 1.0, result.extra
