"""No oracle: what the program is asked never depends on whether its answers passed. Every check of
the tests runs whatever the earlier ones found, and the verdict comes after the whole run.

The probe: the program answers f(1) (right or wrong), and exits when it is asked f(99), which the
tests ask after their check of f(1). The run then ends with "the program under test exited" if,
and only if, the probe was reached; under a harness that stopped at the first failure a wrong first
answer would end with that failure instead. Everything goes through `score_texts`.
"""
import json
import sys

import pytest

from dare_core.rewards.scoring import score_texts

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

PROBE = "import os\ndef f(x):\n    if x == 99:\n        os._exit(0)\n    return {answer}\n"
# layout: (tests, a right answer, a wrong one); each asks f(99) after checking f(1)
LAYOUTS = {
    "top-level asserts": ("assert f(1) == 2\nassert f(99) == 0\n", "2 * x", "3 * x"),
    "HumanEval check()": (json.dumps({"tests": "def check(candidate):\n    assert candidate(1) == 2\n"
                                               "    assert candidate(99) == 0\n", "entry_point": "f"}), "2 * x", "3 * x"),
    "call-based": (json.dumps({"fn_name": "f", "inputs": [[1], [99]], "outputs": [2, 0]}), "2 * x", "3 * x"),
    "unittest, one method": ("import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n"
                             "        self.assertEqual(f(1), 2)\n        self.assertEqual(f(99), 0)\n", "2 * x", "3 * x"),
    # two checks in one `with` body: its first failure must not end the body
    "unittest subtest": ("import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n"
                         "        with self.subTest(x=1):\n            self.assertEqual(f(1), 2)\n"
                         "            self.assertEqual(f(99), 0)\n", "2 * x", "3 * x"),
    "pytest function": ("def test_a():\n    assert f(1) == 2\n    assert f(99) == 0\n", "2 * x", "3 * x"),
    "pytest class": ("class TestF:\n    def test_a(self):\n        assert f(1) == 2\n        assert f(99) == 0\n",
                     "2 * x", "3 * x"),
    "explicit raise": ("def test_a():\n    if abs(f(1) - 2) > 1e-9:\n        raise AssertionError('f(1)')\n    f(99)\n",
                       "2 * x", "3 * x"),
    # `r[1]` raises only because the answer was too short: that must not end the test either
    "error after a failed check": ("def test_a():\n    r = f(1)\n    assert len(r) == 2\n    assert r[1] == 3\n    f(99)\n",
                                   "[2, 3]", "[2]"),
    "and in an assert": ("assert f(1) == 2 and f(99) == 0\n", "2 * x", "3 * x"),
    "all()": ("assert all(f(x) == y for x, y in ((1, 2), (99, 0)))\n", "2 * x", "3 * x"),
}


def _score(cases: list[tuple[str, str]]) -> list:
    rows = [{"task": "code", "uid": f"u{i}", "prompt": "p", "ground_truth": truth} for i, (truth, _) in enumerate(cases)]
    return score_texts(rows, [f"```python\n{program}```" for _, program in cases], workers=2)


def test_the_program_is_asked_the_same_whether_or_not_its_answers_passed():
    # a right first answer always reaches the probe; a wrong one must reach it too
    cases = [(truth, PROBE.format(answer=wrong)) for truth, _, wrong in LAYOUTS.values()]
    for layout, result in zip(LAYOUTS, _score(cases)):
        assert result.extra.get("error") == "the program under test exited", (layout, result.extra)


def test_the_verdict_is_all_or_nothing_at_the_end():
    # without the probe's exit: right answers pass in every layout, wrong ones fail with a count
    answering = PROBE.replace("os._exit(0)", "return 0")
    cases = [(truth, answering.format(answer=answer)) for truth, right, wrong in LAYOUTS.values() for answer in (right, wrong)]
    results = _score(cases)
    for index, layout in enumerate(LAYOUTS):
        right, wrong = results[2 * index], results[2 * index + 1]
        assert (right.score, wrong.score) == (1.0, 0.0), (layout, right.extra, wrong.extra)
        assert "failed check(s), the first:" in wrong.extra["error"], (layout, wrong.extra)
