"""The code sandbox: every test really exercises a limit, with small limits so the file runs in seconds."""
import json
import os
import socket
import statistics
import sys
import time

import pytest

from dare_core.rewards import compute_reward
from dare_core.rewards.code import outputs_match, parse_ground_truth
from dare_core.rewards.extract import extract_code
from dare_core.rewards.sandbox import SandboxLimits, isolation_layers, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=2, memory_mb=256)


def group_members(pid: int) -> list[int]:
    """Live processes whose process group or session is the sandbox child's."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and pid in (int(fields[2]), int(fields[3])):
            members.append(int(entry))
    return members


def run(program, tests=None, **limits):
    result = run_python(program, tests, limits=SandboxLimits(**{**LIMITS.__dict__, **limits}))
    assert not group_members(result.pid), "a sandboxed process outlived its run"
    return result


# ---- the code reward ----

def test_correct_solution_scores_one_and_wrong_zero():
    response = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    tests = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
    assert compute_reward("code", response, tests).score == 1.0
    wrong = compute_reward("code", response.replace("a + b", "a - b"), tests)
    assert (wrong.score, wrong.extra["status"]) == (0.0, "failed")


def test_ground_truth_layouts():
    humaneval = json.dumps({"tests": "def check(candidate):\n    assert candidate(2) == 4\n", "entry_point": "double"})
    assert compute_reward("code", "def double(x):\n    return 2 * x\n", humaneval).score == 1.0
    assert compute_reward("code", "def double(x):\n    return 3 * x\n", humaneval).score == 0.0
    pytest_style = "from solution import double\n\ndef test_double():\n    assert double(3) == 6\n"
    assert compute_reward("code", "def double(x):\n    return 2 * x\n", pytest_style).score == 1.0
    assert compute_reward("code", "def double(x):\n    return x\n", pytest_style).score == 0.0
    call_based = json.dumps({"fn_name": "twoSum", "inputs": [[[2, 7, 11], 9], [[3, 3], 6]],
                             "outputs": [[0, 1], [0, 1]]})
    leetcode = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
                "                return [seen[target - n], i]\n            seen[n] = i\n")
    assert compute_reward("code", leetcode, call_based).score == 1.0


def test_stdin_stdout_tests():
    truth = json.dumps({"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30"]})
    assert parse_ground_truth(truth)["kind"] == "stdio"
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    result = compute_reward("code", good, truth)
    assert (result.score, result.extra["cases_passed"]) == (1.0, 2)
    # reading fd 0 directly works too, and exit() ends a case cleanly
    fd_zero = "import sys\nprint(sum(map(int, open(0).read().split())))\nexit()"
    assert compute_reward("code", fd_zero, truth).score == 1.0
    bad = compute_reward("code", "a, b = map(int, input().split())\nprint(a * b)", truth)
    assert (bad.score, bad.extra["cases_passed"]) == (0.0, 0)
    assert outputs_match("1 2  \n3\n\n", "1 2\n3") and not outputs_match("1 2", "1\n2")


def test_extraction():
    assert extract_code("a\n```py\nx = 1\n```\nb\n```python\nx = 2\n```\n") == "x = 2\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"  # completion style
    assert compute_reward("code", "   ", "assert True").extra == {"extraction_failed": True}


# ---- limits and refusals ----

def test_infinite_loop_is_killed_within_the_limit():
    started = time.monotonic()
    result = run("while True:\n    pass\n", wall_s=1.0)
    elapsed = time.monotonic() - started
    assert (result.passed, result.status, result.timed_out) == (False, "timeout", True)
    assert 1.0 <= elapsed < 2.0
    reward = compute_reward("code", "while True:\n    pass\n", "assert True", {"timeout": 1.0})
    assert (reward.score, reward.extra["timeout"]) == (0.0, True)


def test_cpu_limit_kills_a_busy_child_before_the_wall_clock():
    started = time.monotonic()
    result = run("while True:\n    pass\n", cpu_s=1, wall_s=10.0)
    assert time.monotonic() - started < 5.0
    assert (result.passed, result.status) == (False, "crashed") and "SIGXCPU" in result.error


def test_reading_outside_the_working_directory_is_refused():
    result = run("print(open('/etc/passwd').read())")
    assert (result.passed, result.status) == (False, "refused")
    assert "/etc/passwd" in result.refused and "root:" not in result.stdout
    assert compute_reward("code", "print(open('/etc/passwd').read())", "assert True").score == 0.0
    assert run("import os\nprint(os.listdir('/'))").status == "refused"
    assert run("open('/proc/self/root/etc/passwd').read()").status == "refused"
    assert run("open('../../etc/passwd').read()").status == "refused"
    # its own directory and the standard library are fine
    ok = run("import json, collections\nopen('f.txt', 'w').write('hi')\nprint(open('f.txt').read())")
    assert (ok.passed, ok.stdout) == (True, "hi\n")


def test_writing_outside_the_working_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os\nopen('a', 'w').write('x')\nos.rename('a', {str(target)!r})",
        f"import shutil\nopen('a', 'w').write('x')\nshutil.copy('a', {str(target)!r})",
        f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
    ]
    for program in attempts:
        result = run(program)
        assert (result.passed, result.status) == (False, "refused"), program
    assert not target.exists() and os.listdir(tmp_path) == []
    reward = compute_reward("code", attempts[0], "assert True")
    assert (reward.score, reward.extra["status"]) == (0.0, "refused")


def test_network_is_refused_and_nothing_connects():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        for program in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).send(b'x')",
                        f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)"):
            result = run(program)
            assert (result.passed, result.status) == (False, "refused")
        unix = run("import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('/var/run/docker.sock')")
        assert unix.status == "refused" and "docker.sock" in unix.refused
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@pytest.mark.parametrize("program", [
    "import os\nwhile True:\n    os.fork()\n",
    "import os\nfor _ in range(10000):\n    try:\n        os.fork()\n    except Exception:\n        pass\n",
    "import multiprocessing as mp\nfor _ in range(50):\n    mp.Process(target=sum, args=([],)).start()\n",
    "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n",
    "import os\nos.system('sleep 30 &')\n",
    "import os\nos.posix_spawn('/bin/sleep', ['sleep', '30'], {})\n",
])
def test_process_creation_is_refused_and_nothing_survives(program):
    started = time.monotonic()
    result = run(program)  # run() also asserts that no process of the group or session is left
    assert not result.passed and time.monotonic() - started < 3.0
    assert result.status in ("refused", "failed")


def test_memory_limit():
    result = run("x = bytearray(2 * 1024 ** 3)\n", memory_mb=256)
    assert (result.passed, result.error) == (False, "MemoryError")
    assert run("x = bytearray(64 * 1024 ** 2)\n", memory_mb=256).passed


def test_output_is_capped():
    small = run("print('x' * 5000)", output_bytes=1000)
    assert small.passed and small.truncated and len(small.stdout) == 1000
    flood = run("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n", output_bytes=1000, flood_bytes=1 << 20)
    assert (flood.passed, flood.status) == (False, "output_limit") and len(flood.stdout) == 1000


def test_a_caught_refusal_still_fails_but_a_refused_import_is_only_a_missing_module():
    caught = run("try:\n    open('/etc/passwd')\nexcept OSError:\n    pass\n")
    assert (caught.passed, caught.status) == (False, "refused")
    for program in ("import ctypes", "import importlib\nimportlib.import_module('_ctypes')"):
        result = run(program)
        assert not result.passed and result.error.startswith("ImportError: sandbox")
    optional = run("try:\n    import ssl\nexcept ImportError:\n    ssl = None\nassert ssl is None")
    assert optional.passed
    # asyncio (whose self-pipe is an AF_UNIX socket pair) and threads work
    ok = run("import asyncio, concurrent.futures as cf\nasync def main():\n    return 7\n"
             "with cf.ThreadPoolExecutor(2) as pool:\n    assert list(pool.map(abs, [-1])) == [1]\n"
             "print(asyncio.run(main()))")
    assert (ok.passed, ok.stdout) == (True, "7\n")


def test_other_escape_routes_are_refused():
    for program in ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
                    "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)",
                    "import gc\ngc.get_objects()"):
        result = run(program)
        assert (result.passed, result.status) == (False, "refused"), program
    # a native module copied into the working directory cannot be loaded
    load_copy = (
        "import os, shutil, importlib.machinery as m, importlib.util as u\n"
        "d = os.path.join(os.path.dirname(os.__file__), 'lib-dynload')\n"
        "name = next(f for f in os.listdir(d) if f.startswith('_bisect'))\n"
        "shutil.copy(os.path.join(d, name), 'copy.so')\n"
        "spec = u.spec_from_loader('_bisect', m.ExtensionFileLoader('_bisect', os.path.abspath('copy.so')))\n"
        "u.module_from_spec(spec)\n")
    result = run(load_copy)
    assert result.status == "refused" and "native code" in result.refused


def test_exiting_before_the_tests_finish_never_passes():
    for program in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"):
        assert not run(program, "assert False").passed, program


def test_layers_and_speed():
    prefix, layers = isolation_layers()
    result = run("print(1)")
    assert result.passed and {"setsid", "workdir", "rlimits", "audit_hook"} <= set(result.layers)
    assert set(layers) <= set(result.layers)
    times = []
    for _ in range(5):
        started = time.monotonic()
        assert run_python("def f(x):\n    return x\n", "assert f(1) == 1", limits=LIMITS).passed
        times.append(time.monotonic() - started)
    assert statistics.median(times) < 0.5
