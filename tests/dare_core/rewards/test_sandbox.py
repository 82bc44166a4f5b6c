"""The code sandbox: the code reward's results, its limits, and what the jail keeps out.

Small limits keep the file to seconds. After every run, `run` checks that no process of either jail
is left (by PID namespace).
"""
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Optional

import pytest

from dare_core.rewards import compute_reward
from dare_core.rewards.code import outputs_match, parse_ground_truth
from dare_core.rewards.extract import extract_code
from dare_core.rewards.sandbox import SandboxLimits, SandboxUnavailable, check_available, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

# a program that sleeps ends at the wall-clock backstop, wall_s * backstop
LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, backstop=1.5)


def _running(pid: str) -> bool:
    """Not a zombie: bubblewrap's first process, once orphaned, waits for the host's init to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def jail_processes(namespace: int) -> list[int]:
    """Running processes in a jail's PID namespace."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == f"pid:[{namespace}]" and _running(entry):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def assert_jails_gone(result) -> None:
    assert result.jails and all("pid-namespace" in info for info in result.jails)
    for info in result.jails:
        deadline = time.monotonic() + 2
        while jail_processes(info["pid-namespace"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not jail_processes(info["pid-namespace"]), "a jailed process outlived its run"


def run(program, tests=None, inputs=None, **limits):
    result = run_python(program, tests, inputs, limits=SandboxLimits(**{**LIMITS.__dict__, **limits}))
    assert_jails_gone(result)
    return result


def output(program, **limits) -> str:
    """What the program prints (run as a stdin/stdout case), failing the test if it raised."""
    result = run(program, inputs=[""], **limits)
    assert result.passed, (result.status, result.error, result.stderr)
    return result.cases[0]["stdout"]


# ---- the code reward ------------------------------------------------------------------------------

def test_correct_solution_scores_one_and_wrong_zero():
    response = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    tests = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
    assert compute_reward("code", response, tests).score == 1.0
    wrong = compute_reward("code", response.replace("a + b", "a - b"), tests)
    assert (wrong.score, wrong.extra["status"]) == (0.0, "failed")
    crashed = compute_reward("code", "def add(a, b):\n    return a +", tests)
    assert crashed.score == 0.0 and "SyntaxError" in crashed.extra["error"]


def test_ground_truth_layouts():
    humaneval = json.dumps({"tests": "def check(candidate):\n    assert candidate(2) == 4\n", "entry_point": "double"})
    assert compute_reward("code", "def double(x):\n    return 2 * x\n", humaneval).score == 1.0
    assert compute_reward("code", "def double(x):\n    return 3 * x\n", humaneval).score == 0.0
    pytest_style = "from solution import double\n\ndef test_double():\n    assert double(3) == 6\n"
    assert compute_reward("code", "def double(x):\n    return 2 * x\n", pytest_style).score == 1.0
    assert compute_reward("code", "def double(x):\n    return x\n", pytest_style).score == 0.0
    unittest_style = ("import unittest\nclass T(unittest.TestCase):\n    def test_it(self):\n"
                      "        self.assertEqual(double(4), 8)\n        with self.assertRaises(ValueError):\n"
                      "            double(-1)\n")
    raising = "def double(x):\n    if x < 0:\n        raise ValueError('negative')\n    return 2 * x\n"
    assert compute_reward("code", raising, unittest_style).score == 1.0
    assert compute_reward("code", "def double(x):\n    return 2 * x\n", unittest_style).score == 0.0
    call_based = json.dumps({"fn_name": "twoSum", "inputs": [[[2, 7, 11], 9], [[3, 3], 6]],
                             "outputs": [[0, 1], [0, 1]]})
    leetcode = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
                "                return [seen[target - n], i]\n            seen[n] = i\n")
    assert compute_reward("code", leetcode, call_based).score == 1.0
    assert compute_reward("code", leetcode.replace("[seen[target - n], i]", "[i, i]"), call_based).score == 0.0


def test_values_cross_between_the_jails_as_plain_python():
    program = ("import math\nLIMIT = 10\ndef pair(x):\n    return (x, [x], {x: {x}}, frozenset([x]), b'ab', 1j, math.inf)\n"
               "class Box:\n    def __init__(self, v):\n        self.v = v\n    def get(self):\n        return self.v\n")
    tests = ("assert pair(3) == (3, [3], {3: {3}}, frozenset([3]), b'ab', 1j, float('inf'))\n"
             "assert type(pair(3)[0]) is int and LIMIT == 10\n"
             "box = Box([1, 2])\nassert box.get() == [1, 2] and box.v == [1, 2]\n"
             "assert math.sqrt(4) == 2.0\n")  # `math` is the tests' own module, imported like the program's
    result = run(program, tests)
    assert result.passed, result.error


def test_stdin_stdout_tests():
    truth = json.dumps({"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30"]})
    assert parse_ground_truth(truth)["kind"] == "stdio"
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    result = compute_reward("code", good, truth)
    assert (result.score, result.extra["cases_passed"]) == (1.0, 2)
    # reading fd 0 directly and writing fd 1 directly work too, and exit() ends a case cleanly
    fd_level = "import os, sys\nos.write(1, str(sum(map(int, open(0).read().split()))).encode())\nexit()"
    assert compute_reward("code", fd_level, truth).score == 1.0
    bad = compute_reward("code", "a, b = map(int, input().split())\nprint(a * b)", truth)
    assert (bad.score, bad.extra["cases_passed"]) == (0.0, 0)
    assert outputs_match("1 2  \n3\n\n", "1 2\n3") and not outputs_match("1 2", "1\n2")


def test_extraction():
    assert extract_code("a\n```py\nx = 1\n```\nb\n```python\nx = 2\n```\n") == "x = 2\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"  # completion style
    assert compute_reward("code", "   ", "assert True").extra == {"extraction_failed": True}


# ---- limits ---------------------------------------------------------------------------------------

def test_infinite_loop_is_killed_at_its_time_limit():
    # the limit counts the CPU time of the run's jails where their cgroups count it, else wall clock
    started = time.monotonic()
    result = run("def f():\n    while True:\n        pass\n", "f()", wall_s=1.0, cpu_s=5)
    elapsed = time.monotonic() - started
    assert (result.passed, result.status, result.timed_out) == (False, "timeout", True)
    assert elapsed < LIMITS.backstop * 1.0 + 0.5
    if result.cpu_s is not None:
        assert result.cpu_s >= 1.0 and result.error.startswith("CPU time limit 1 s"), result.error
    else:
        assert elapsed >= 1.0 and result.error == "wall clock limit 1 s"
    reward = compute_reward("code", "while True:\n    pass\n", "assert True", {"timeout": 1.0})
    assert (reward.score, reward.extra["timeout"]) == (0.0, True)


def test_a_program_that_waits_ends_at_the_wall_clock_backstop():
    started = time.monotonic()
    result = run("import time\ntime.sleep(60)\n", inputs=[""], wall_s=1.0, backstop=2.0)
    assert result.status == "timeout" and 2.0 <= time.monotonic() - started < 3.0
    if result.cpu_s is not None:  # it did not run out of CPU time: the reason says it waited
        assert result.error.startswith("wall clock backstop 2 s") and "waited" in result.error, result.error


def test_cpu_limit_kills_a_busy_process_before_the_wall_clock():
    started = time.monotonic()
    result = run("while True:\n    pass\n", inputs=[""], cpu_s=1, wall_s=10.0)
    assert time.monotonic() - started < 5.0
    assert (result.passed, result.status) == (False, "crashed") and "SIGXCPU" in result.error


def test_memory_limit():
    result = run("x = bytearray(2 * 1024 ** 3)\n", inputs=[""], memory_mb=256)
    assert not result.passed and result.error == "MemoryError"
    assert run("x = bytearray(64 * 1024 ** 2)\n", inputs=[""], memory_mb=256).passed


def test_work_dir_and_file_size_are_capped():
    big_file = run("open('big', 'wb').write(b'x' * (8 << 20))\n", inputs=[""], file_mb=1)
    assert not big_file.passed and "File too large" in big_file.error
    full = run("for i in range(64):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n", inputs=[""], file_mb=4, work_mb=8)
    assert not full.passed and "No space left" in full.error


def test_output_is_capped():
    small = run("print('x' * 5000)", inputs=[""], output_bytes=1000)
    assert small.passed and small.cases[0]["truncated"] and len(small.cases[0]["stdout"]) == 1000
    flood = run("import sys\nwhile True:\n    sys.stderr.write('y' * 65536)\n", inputs=[""], output_bytes=1000,
                flood_bytes=1 << 20)
    assert (flood.passed, flood.status) == (False, "output_limit") and len(flood.stderr) == 1000


@pytest.mark.parametrize("program", [
    "import os\nwhile True:\n    os.fork()\n",
    "import os\nfor _ in range(10000):\n    try:\n        os.fork()\n    except Exception:\n        pass\nimport time\ntime.sleep(30)\n",
    "import threading, time\nfor _ in range(1000):\n    threading.Thread(target=time.sleep, args=(30,)).start()\n",
    "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n",
    "import os\nos.system('sleep 30 &')\n",
    "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(60)\n",  # a detached child
])
def test_processes_are_capped_and_nothing_survives(program):
    started = time.monotonic()
    result = run(program, inputs=[""])  # run() asserts that no process of the jail is left
    assert time.monotonic() - started < LIMITS.wall_s * LIMITS.backstop + 1.5
    assert result.status in ("passed", "failed", "timeout", "crashed")
    assert not _jailed(os.getpid())


# ---- what the jail keeps out ----------------------------------------------------------------------

def test_the_jail_sees_only_the_interpreter_and_its_work_dir():
    listing = json.loads(output("import os, json, sys\nprint(json.dumps({p: sorted(os.listdir(p)) for p in "
                                "('/', '/py', '/py/bin', '/py/lib', '/sandbox')} | {'path': sys.path}))"))
    assert {"dev", "proc", "py", "sandbox"} <= set(listing["/"]) <= {"dev", "lib", "lib64", "proc", "py", "sandbox"}
    assert listing["/py"] == ["bin", "lib"] and listing["/py/bin"] == ["python3", "python3._pth"]
    # its own copy: the standard library as one zip, the extension modules, the shared libraries
    assert listing["path"] == ["/py/lib/stdlib.zip", "/py/lib/lib-dynload"]
    assert {"stdlib.zip", "lib-dynload"} <= set(listing["/py/lib"])
    assert all(n.endswith(".zip") or ".so" in n or n == "lib-dynload" for n in listing["/py/lib"])
    assert listing["/sandbox"] == [".case0.out", "solution.py"]  # the source, and this case's captured stdout
    assert output("import importlib.util\nprint(importlib.util.find_spec('pip'), importlib.util.find_spec('idlelib'))") \
        == "None None\n"  # no site-packages, no IDE
    # and nothing of this machine: no /etc, no home, no repository, no virtual environment
    for path in ("/etc/passwd", os.path.expanduser("~"), os.getcwd(), sys.prefix, os.path.dirname(json.__file__)):
        assert output(f"import os\nprint(os.path.exists({path!r}))") == "False\n", path


def test_the_jail_runs_unprivileged_without_capabilities_and_a_read_only_root():
    facts = json.loads(output(
        "import os, json\nstatus = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "writable = {}\nfor p in ('/', '/py', '/py/lib', '/dev', '/sandbox'):\n"
        "    try:\n        open(p + '/x', 'w').close()\n        writable[p] = True\n    except OSError:\n        writable[p] = False\n"
        "print(json.dumps({'uid': os.getuid(), 'euid': os.geteuid(), 'gid': os.getgid(), 'groups': os.getgroups(),\n"
        "    'cap_eff': status['CapEff'].strip(), 'cap_prm': status['CapPrm'].strip(), 'nnp': status['NoNewPrivs'].strip(),\n"
        "    'uid_map': open('/proc/self/uid_map').read().split(), 'pid': os.getpid(), 'writable': writable}))"))
    assert facts["uid"] != 0 and facts["euid"] != 0 and facts["gid"] != 0 and facts["groups"] == []
    assert int(facts["cap_eff"], 16) == 0 and int(facts["cap_prm"], 16) == 0 and facts["nnp"] == "1"
    if os.geteuid() == 0:  # no user namespace: the uid is unprivileged on the host itself
        assert facts["uid_map"] == ["0", "0", "4294967295"] and facts["uid"] >= 1_000_000_000
    assert facts["pid"] <= 3  # its own PID namespace
    assert facts["writable"] == {"/": False, "/py": False, "/py/lib": False, "/dev": False, "/sandbox": True}


def test_network_is_unreachable_and_nothing_connects():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        connect = f"import socket\ndef leak():\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).send(b'x')\n    return 1\n"
        assert compute_reward("code", connect, "assert leak() == 1").score == 0.0
        lookup = "import socket\ndef leak():\n    return socket.gethostbyname('example.com')\n"
        assert compute_reward("code", lookup, "assert leak() == '93.184.215.14'").score == 0.0
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    # the network namespace's own interfaces: its loopback only
    assert output("print([l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]])") == "['lo']\n"


# ---- the escapes found against the old sandbox, through the public reward API ----------------------

def _secret_file(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    return secret


def test_native_code_through_cffi_or_ctypes_cannot_reach_the_host(tmp_path):
    import sysconfig

    marker = tmp_path / "pwned"
    site = sysconfig.get_paths()["purelib"]
    # `f()` returns libc's system() status: 0 only if a shell ran the command
    via_cffi = (f"import sys\nsys.path.append({site!r})\ndef f():\n    import cffi\n    ffi = cffi.FFI()\n"
                f"    ffi.cdef('int system(const char *);')\n    return ffi.dlopen(None).system(b'touch {marker}; id')\n")
    via_ctypes = f"import ctypes\ndef f():\n    return ctypes.CDLL(None).system(b'touch {marker}')\n"
    for program in (via_cffi, via_ctypes):
        result = compute_reward("code", program, "assert f() == 0")
        assert (result.score, result.extra["status"]) == (0.0, "failed") and not marker.exists()
    assert "No module named 'cffi'" in compute_reward("code", via_cffi, "assert f() == 0").extra["error"]
    # native code itself runs (ctypes is in the standard library); it is the jail that holds
    assert output("import ctypes\nprint(ctypes.CDLL(None).getuid() != 0)") == "True\n"


def test_patching_path_functions_reads_nothing_of_the_host(tmp_path):
    secret = _secret_file(tmp_path)
    params = os.path.join(os.getcwd(), "params.yaml")
    program = ("import os, posixpath\nposixpath.abspath = lambda p: os.getcwd() + '/ok'\nos.path.realpath = lambda p, **k: p\n"
               f"def leak():\n    return open({str(secret)!r}).read()\n"
               f"def config():\n    return open({params!r}).read()[:5] + open('/etc/passwd').read()[:4]\n")
    assert compute_reward("code", program, "assert leak() == 'hunter2'").score == 0.0
    assert compute_reward("code", program, "assert config()[-4:] == 'root'").score == 0.0


def test_nothing_can_be_written_into_the_environment_or_outside(tmp_path):
    import sysconfig

    targets = [os.path.join(sysconfig.get_paths()["purelib"], "dare_pwned.pth"), str(tmp_path / "escaped.txt"),
               os.path.join(os.path.dirname(os.__file__), "dare_pwned.py")]
    for target in targets:
        program = (f"import os\ndef f():\n    os.makedirs(os.path.dirname({target!r}), exist_ok=True)\n"
                   f"    open({target!r}, 'w').write('import os; os.system(\"id\")')\n    return 1\n")
        assert compute_reward("code", program, "assert f() == 1").score == 0.0
        assert not os.path.exists(target), target
    assert os.listdir(tmp_path) == []


def _victim():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.2)
    return victim


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_no_signal_reaches_the_trainer_or_any_host_process(sig):
    victim = _victim()
    try:
        program = (f"import os, signal\ndef f():\n    for pid in (os.getppid(), {os.getpid()}, {victim.pid}, 1, -1):\n"
                   f"        for send in (lambda p: os.kill(p, signal.{sig}),\n"
                   f"                     lambda p: signal.pidfd_send_signal(os.pidfd_open(p), signal.{sig})):\n"
                   f"            try:\n                send(pid)\n            except Exception:\n                pass\n"
                   f"    return os.getppid()\n")
        result = compute_reward("code", program, f"assert f() == {os.getpid()}")
        assert result.score == 0.0  # the jail cannot even name the trainer's pid
        assert victim.poll() is None and _state(victim.pid) in ("S", "R")
        assert _state(os.getpid()) in ("S", "R")
    finally:
        victim.kill()
        victim.wait()


def test_forged_verdicts_score_zero():
    forgeries = [
        # the old harness's verdict function, found by walking frames
        "import sys\ndef f(x):\n    frame = sys._getframe(1)\n    while frame:\n"
        "        for name in ('finish', 'report'):\n            fn = frame.f_locals.get(name) or frame.f_globals.get(name)\n"
        "            if callable(fn):\n                try:\n                    fn({'ok': True}) if name == 'finish' else fn(3, {'ok': True})\n"
        "                except Exception:\n                    pass\n        frame = frame.f_back\n    return 0\n",
        # a verdict written to every descriptor, then a clean exit
        "import os, json\ndef f(x):\n    for fd in range(100):\n        for blob in (b'R{\"ok\": true}', json.dumps({'value': 4}).encode()):\n"
        "            try:\n                os.write(fd, len(blob).to_bytes(4, 'big') + blob)\n            except OSError:\n"
        "                pass\n    os._exit(0)\n",
        # objects that claim to equal anything, or to be true
        "class Equal:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\ndef f(x):\n    return Equal()\n",
        "class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\ndef f(x):\n    return Int(7)\n",
        "class Yes:\n    def __bool__(self):\n        return True\ndef f(x):\n    return Yes()\n",
        # changing the tests' builtins from the candidate's side
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\ndef abs(x):\n    return 0\ndef f(x):\n    return -1\n",
    ]
    tests = "assert f(2) == 4\nassert f(3)\nassert abs(f(2) - 4) < 1e-9\n"
    for program in forgeries:
        result = compute_reward("code", program, tests)
        assert result.score == 0.0, (program, result.extra)
    # the same tests pass for an honest answer
    assert compute_reward("code", "def f(x):\n    return 2 * x\n", tests).score == 1.0


def test_the_jail_dies_with_the_trainer():
    """A trainer killed mid-run (SIGKILL: no cleanup of its own) takes its jails with it."""
    script = ("import sys\nsys.path.insert(0, %r)\nfrom dare_core.rewards.sandbox import run_python, SandboxLimits\n"
              "print('started', flush=True)\nrun_python('import time\\ntime.sleep(60)', inputs=[''], "
              "limits=SandboxLimits(wall_s=60, cpu_s=60))\n") % os.getcwd()
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    trainer.stdout.readline()
    # (a jail starts in well under a second; the margin is for a machine that other work keeps busy)
    deadline = time.monotonic() + 30
    while not _jailed(trainer.pid) and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    jailed = set(_jailed(trainer.pid))
    if not jailed:
        trainer.kill()
        _, err = trainer.communicate()
        pytest.fail(f"the jail did not start (trainer exit {trainer.returncode}):\n{err.decode(errors='replace')[-3000:]}")
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 5
    while set(_jailed()) & jailed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(_jailed()) & jailed


def _jailed(ancestor: Optional[int] = None) -> list[int]:
    """Processes running the sandbox's start-up code (its source is on their command line); with
    `ancestor`, those below that process only. A jailed process never leaves that tree: one whose
    parent dies goes to its PID namespace's init, a child of bubblewrap, and new namespaces are
    denied. Other test processes (pytest-xdist's other worker) run jails of their own meanwhile."""
    import psutil

    found = []
    below = None if ancestor is None else {p.pid for p in psutil.Process(ancestor).children(recursive=True)}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (below is None or int(entry) in below):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"Trusted start-up code of a jailed process" in f.read() and _running(entry):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_no_host_temp_dirs_and_no_fallback_without_bubblewrap(monkeypatch):
    import tempfile

    before = set(os.listdir(tempfile.gettempdir()))
    assert compute_reward("code", "def f():\n    return 1\n", "assert f() == 1").score == 1.0
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before if "sandbox" in n]
    monkeypatch.setenv("DARE_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        compute_reward("code", "def f():\n    return 1\n", "assert f() == 1")
    monkeypatch.setenv("DARE_BWRAP", "/bin/false")  # a jail that never starts is not a score of 0
    with pytest.raises(SandboxUnavailable, match="could not start"):
        run_python("print(1)")


@pytest.mark.skipif(not shutil.which("make"), reason="no make here")
def test_a_fresh_machine_is_told_and_given_the_one_command_that_installs_bubblewrap(monkeypatch):
    monkeypatch.setenv("DARE_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match=r"run `make sandbox`"):
        run_python("print(1)")
    # the targets that run the pipeline install it first (a no-op where bwrap is there)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    for target in ("run", "repro"):
        planned = subprocess.run(["make", "-n", target], cwd=repo, capture_output=True, text=True, timeout=60)
        assert "install -y --no-install-recommends bubblewrap" in planned.stdout, (target, planned.stderr[-500:])


def test_availability_and_speed():
    assert check_available() in ("setuid", "userns")
    times = []
    for _ in range(5):
        started = time.monotonic()
        assert run_python("def f(x):\n    return x\n", "assert f(1) == 1", limits=LIMITS).passed
        times.append(time.monotonic() - started)
    assert statistics.median(times) < 0.5


@pytest.mark.parametrize("attack", [
    # each `f()` returns 0 only if the attack worked, and the tests ask for 0: a score of 1 would be an escape
    "import subprocess\ndef f():\n    return subprocess.run(['id']).returncode\n",
    "import os\ndef f():\n    return os.system('id')\n",
    "import os\ndef f():\n    return 0 if os.fork() >= 0 and os.execv('/bin/sh', ['sh', '-c', 'id']) else 1\n",
    "def f():\n    walk = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close']\n"
    "    return walk[0].__init__.__globals__['system']('id')\n",
    "import os\ndef f():\n    return 0 if os.environ.get('DARE_PLANTED_SECRET') == 'hunter2' or "
    "b'hunter2' in open('/proc/1/environ', 'rb').read() else 1\n",
    "import sys\nsys.exit(0)\ndef f():\n    return 1\n",
    "import os\ndef f():\n    os._exit(0)\n",
    "import sys\ndef f():\n    raise SystemExit(0)\n",
])
def test_the_old_refusals_still_score_zero(attack, monkeypatch):
    monkeypatch.setenv("DARE_PLANTED_SECRET", "hunter2")  # the trainer's environment never reaches the jail
    result = compute_reward("code", attack, "assert f() == 0")
    assert result.score == 0.0, result.extra


def test_a_dead_program_fails_even_tests_that_catch_every_exception():
    tests = "try:\n    f(-1)\nexcept Exception:\n    pass\nelse:\n    raise AssertionError('no error')\n"
    assert compute_reward("code", "def f(x):\n    raise ValueError(x)\n", tests).score == 1.0
    assert compute_reward("code", "import os\ndef f(x):\n    os._exit(0)\n", tests).score == 0.0
