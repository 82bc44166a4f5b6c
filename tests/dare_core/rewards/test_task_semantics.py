"""The tests decide with the task's semantics: the names they call are the task's (a function named
like a builtin too). Everything goes through `score_texts`.
"""
import sys

import pytest

from dare_core.rewards.scoring import score_texts

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")


def scores(cases: list[tuple], prompt: str = "Write the function.") -> list[float]:
    """Scores of (program, tests[, prompt]) cases, graded in one batch."""
    rows = [{"task": "code", "uid": f"u{i}", "prompt": case[2] if len(case) > 2 else prompt, "ground_truth": case[1]}
            for i, case in enumerate(cases)]
    return [r.score for r in score_texts(rows, [f"```python\n{case[0]}```" for case in cases], workers=2)]


def test_a_builtin_named_function_is_the_programs_when_the_task_means_it():
    # no entry point, no other name of the program's: the tests mean the program's `max`
    tests = "assert max([3, 1, 2]) == 3\nassert max([-1, -5]) == -1\n"
    right = "def max(xs):\n    best = xs[0]\n    for x in xs:\n        best = x if x > best else best\n    return best\n"
    # the prompt leaves `sum` to write; the tests also use another name of the program's
    stub = "```python\ndef sum(xs):\n    \"\"\"The sum of xs.\"\"\"\n```"
    doubled = "def double(xs):\n    return [2 * x for x in xs]\n"
    total = "def sum(xs):\n    t = 0\n    for x in xs:\n        t += x\n    return t\n"
    assert scores([
        ("def max(xs):\n    return 0\n", tests), (right, tests),
        ("def largest(xs):\n    return 3\n", tests),  # not defined: Python's max does not stand in
        (doubled + "def sum(xs):\n    return 0\n", "assert sum(double([1, 2])) == 6\n", stub),
        (doubled + total, "assert sum(double([1, 2])) == 6\n", stub),
    ]) == [0.0, 1.0, 0.0, 0.0, 1.0]
