"""The tests decide alone: which names the tests run against, which builtins, modules and helpers they
see, and how the candidate's exceptions reach them are the task's, never the candidate's.

Every forgery goes through the public scoring API (`score_texts`, with the graded row) and must
score 0; the correct program of each supported layout must score 1.
"""
import json
import sys

import pytest

from dare_core.rewards.scoring import score_texts

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")


def score(program: str, ground_truth: str, prompt: str = "Write the function.") -> float:
    row = {"task": "code", "uid": "t", "prompt": prompt, "ground_truth": ground_truth}
    return score_texts([row], [f"```python\n{program}```"])[0].score


# A candidate that answers the tests itself: it takes over its process's end of the channel (the
# start-up code's own helpers are right there in `__main__`) and sends a manifest of its choosing.
FORGER = '''import os, sys, __main__ as boot
_frame = sys._getframe()
while not isinstance(_frame.f_locals.get("job"), dict):
    _frame = _frame.f_back
_channel = boot.Channel(*_frame.f_locals["job"]["channel"])
_objects = []

def _ref(value):
    _objects.append(value)
    return {"$": "ref", "id": len(_objects) - 1, "type": type(value).__name__}

def _serve(names):
    _channel.send({"names": {k: boot.encode(v, _ref) for k, v in names.items()}})
    while (request := _channel.receive()) is not None:
        try:
            target, take = _objects[request["target"]], (lambda m: _objects[m["id"]])
            if request["op"] == "call":
                value = target(*boot.decode(request["args"], take), **boot.decode(request["kwargs"], take))
            else:
                value = getattr(target, request["name"])
            reply = {"value": boot.encode(value, _ref)}
        except BaseException as exc:
            reply = {"raise": {"type": type(exc).__name__, "message": str(exc)}}
        _channel.send(reply)
    os._exit(0)

class Anything:  # whatever the tests ask of it: `loads` gives empty argument lists, the rest 7
    def __getattr__(self, name):
        return (lambda text: [] if text.startswith("[") else 7) if name == "loads" else (lambda *a, **k: 7)
    def get(self, *args):
        return 0
'''


def test_a_forged_builtins_module_is_never_the_tests():
    # the call-based layout with no solution at all: `import`, `globals` and `getattr` of the tests
    # would be the candidate's, and every answer the expected one
    call_based = json.dumps({"fn_name": "f", "inputs": [[1], [2]], "outputs": [7, 7]})
    forged_import = FORGER + ("_serve({'__builtins__': {'__import__': lambda *a: Anything(), 'globals': Anything,\n"
                              "    'getattr': lambda *a: Anything().x, 'Solution': Anything}})\n")
    assert score(forged_import, call_based) == 0.0
    # wrong answers against `set(...) ==` and `abs(...) <` checks, with the candidate's set and abs
    tests = "assert set(f([1, 2])) == set([2, 1])\nassert abs(g(2) - 0.5) < 1e-9\n"
    forged_math = FORGER + ("def f(x):\n    return [9]\ndef g(x):\n    return 100\n"
                            "_serve({'f': f, 'g': g, '__builtins__': {'set': lambda *a: 0, 'abs': lambda *a: 0}})\n")
    assert score(forged_math, tests) == 0.0
    honest = "def f(x):\n    return list(reversed(x))\ndef g(x):\n    return 1 / x\n"
    assert score(honest, tests) == 1.0


def test_a_module_the_tests_use_without_importing_is_their_own():
    tests = "assert math.isclose(f(2), 1.4142135623730951)\n"
    shadow = "class math:\n    @staticmethod\n    def isclose(a, b):\n        return True\ndef f(x):\n    return 0\n"
    assert score(shadow, tests) == 0.0
    assert score("import math\ndef f(x):\n    return math.sqrt(x)\n", tests) == 1.0


CYCLIC = '''def encode_cyclic(s: str):
    """returns encoded string by cycling groups of three characters."""
    groups = [s[(3 * i):min((3 * i + 3), len(s))] for i in range((len(s) + 2) // 3)]
    groups = [(group[1:] + group[0]) if len(group) == 3 else group for group in groups]
    return "".join(groups)


def decode_cyclic(s: str):
    """
    takes as input string encoded with encode_cyclic function. Returns decoded string.
    """
'''
POLY = '''import math


def poly(xs: list, x: float):
    """Evaluates polynomial with coefficients xs at point x."""
    return sum([coeff * math.pow(x, i) for i, coeff in enumerate(xs)])


def find_zero(xs: list):
    """ xs are coefficients of a polynomial of even length: find x such that poly(x) = 0. """
'''
HELPER_TASKS = {
    "HumanEval/38": (CYCLIC, "decode_cyclic",
                     "def check(candidate):\n    for s in ('abcdefgh', 'hello world', 'xy'):\n"
                     "        assert candidate(encode_cyclic(s)) == s\n",
                     "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n",
                     "def decode_cyclic(s):\n    return encode_cyclic(encode_cyclic(s))\n"),
    "HumanEval/32": (POLY, "find_zero",
                     "import math\n\ndef check(candidate):\n    for xs in ([1, 2], [-6, 11, -6, 1]):\n"
                     "        assert math.fabs(poly(xs, candidate(xs))) < 1e-4\n",
                     "def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 123.0\n",
                     "def find_zero(xs):\n    lo, hi = -100.0, 100.0\n    while hi - lo > 1e-10:\n"
                     "        mid = (lo + hi) / 2\n        if (poly(xs, lo) > 0) == (poly(xs, mid) > 0):\n"
                     "            lo = mid\n        else:\n            hi = mid\n    return lo\n"),
}


@pytest.mark.parametrize("task", sorted(HELPER_TASKS))
def test_helpers_of_the_prompt_are_the_tasks(task):
    prompt_code, entry, tests, forged, solution = HELPER_TASKS[task]
    prompt = f"Complete the following Python function.\n\n```python\n{prompt_code}```"
    truth = json.dumps({"tests": tests, "entry_point": entry})
    assert score(prompt_code + "\n" + forged, truth, prompt) == 0.0
    assert score(prompt_code + "\n" + solution, truth, prompt) == 1.0


def test_a_relayed_exception_cannot_steer_the_tests():
    # a StopIteration from the candidate would end the tests' map() early: all([]) is True
    tests = "assert all(map(lambda case: f(case[0]) == case[1], [(1, 2), (2, 4)]))\n"
    assert score("def f(x):\n    raise StopIteration\n", tests) == 0.0
    assert score("def f(x):\n    return 2 * x\n", tests) == 1.0
    # tests still catch the builtin class they expect, and only that one
    expects = ("try:\n    f(-1)\nexcept ValueError as exc:\n    assert 'negative' in str(exc)\n"
               "else:\n    raise AssertionError\n")
    assert score("def f(x):\n    raise ValueError('negative')\n", expects) == 1.0
    assert score("def f(x):\n    raise TypeError('negative')\n", expects) == 0.0
    swallowed = "try:\n    f(1)\nexcept AssertionError:\n    pass\nelse:\n    raise AssertionError('f(1) must fail')\n"
    assert score("def f(x):\n    raise AssertionError\n", swallowed) == 0.0
    # a reply the tests cannot rebuild (a dict with a list as key) is no TypeError of theirs to catch
    unhashable = FORGER + ('_channel.send({"names": {"f": {"$": "ref", "id": 0, "type": "function"}}})\n'
                           '_channel.receive()\n_channel.send({"value": {"$": "dict", "v": [[[1], 1]]}})\n'
                           'os._exit(0)\n')
    assert score(unhashable, "try:\n    f(1)\nexcept TypeError:\n    pass\nelse:\n    raise AssertionError\n") == 0.0


@pytest.mark.parametrize("entry", ["max", "sum"])
def test_an_entry_point_named_like_a_builtin_is_the_candidates(entry):
    truth = json.dumps({"tests": "def check(candidate):\n    assert candidate([3, 1, 2]) == 3\n", "entry_point": entry})
    assert score(f"def {entry}(xs):\n    return 0\n", truth) == 0.0
    assert score("def other(xs):\n    return 3\n", truth) == 0.0  # not defined: not the builtin either
    assert score(f"def {entry}(xs):\n    best = xs[0]\n    for x in xs:\n        best = x if x > best else best\n"
                 f"    return best\n", truth) == 1.0


def test_correct_programs_pass_in_every_layout():
    add = "def add(a, b):\n    return a + b\n"
    call_based = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]})
    assert score(add, call_based) == 1.0  # a top-level function
    assert score("class Solution:\n    def add(self, a, b):\n        return a + b\n", call_based) == 1.0
    assert score(add.replace("+", "-"), call_based) == 0.0
    main = ("import unittest\n\nclass T(unittest.TestCase):\n    def test_add(self):\n"
            "        self.assertEqual(add(1, 2), 3)\n\nif __name__ == '__main__':\n    unittest.main()\n")
    assert score(add, main) == 1.0 and score(add.replace("+", "-"), main) == 0.0
    humaneval = json.dumps({"tests": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"})
    assert score(add, humaneval) == 1.0
    mbpp = json.dumps({"tests": "assert floor_add(1.5, 2.25) == math.floor(3.75)", "setup": "import math"})
    assert score("def floor_add(a, b):\n    return math.floor(a + b)\n", mbpp) == 1.0
    pytest_style = "from solution import add\n\ndef test_add():\n    assert add(2, 2) == 4\n"
    assert score(add, pytest_style) == 1.0
