"""The tests decide with the task's semantics: the names they call are the task's (a function named
like a builtin too), a NaN never passes a numeric check, and correct programs pass in the layouts
where values crossing between the jails used to lose them: a generator, an argument changed in
place, tests that import pytest, instances of the program's own class, a tuple for a list. Each
one also keeps the forgery it could open closed. Everything goes through `score_texts`.
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


def test_a_nan_never_passes_a_numeric_check():
    close = "r = f(2)\nif abs(r - 0.5) > 1e-9:\n    raise AssertionError(r)\n"
    elementwise = "for got, want in zip(g(), [1.0, 2.0]):\n    if abs(got - want) > 1e-9:\n        raise AssertionError\n"
    assert scores([
        ("def f(x):\n    return float('nan')\n", close),
        ("def g():\n    return [float('nan'), 2.0]\n", elementwise),
        ("def f(x):\n    return 1 / x\n", close),
        ("def g():\n    return [1.0, 2.0]\n", elementwise),
        ("def f(x):\n    return float('nan')\n", "import math\nassert math.isnan(f(0))\n"),  # the task expects NaN
    ]) == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_a_generator_is_the_list_it_yields():
    tests = ("assert squares(3) == [0, 1, 4]\nassert list(squares(2)) == [0, 1]\nassert sum(squares(4)) == 14\n"
             "g = squares(3)\nassert next(g) == 0 and next(g) == 1\n")
    right = "def squares(n):\n    for i in range(n):\n        yield i * i\n"
    assert scores([(right, tests), (right.replace("i * i", "i"), tests)]) == [1.0, 0.0]


def test_an_argument_changed_in_place_is_what_the_tests_check():
    in_place = "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]\n"
    right = "def sort_in_place(xs):\n    xs.sort()\n"
    # an answer that returns a value cannot also rewrite the data it is compared with, not even
    # from a serving side it patched to send the arguments back with every reply
    compared = "xs = [3, 1, 2]\nassert sort_copy(xs) == sorted(xs)\n"
    forged = ("import sys, __main__ as boot\nserving = sys.modules['_harness_serve']\n"
              "def _answer(request, reference, handle, pending):\n"
              "    args = boot.decode(request['args'], reference)\n"
              "    value = reference({'id': request['target']})(*args)\n"
              "    return {'value': boot.encode(value, handle), 'after': boot.encode({'args': args, 'kwargs': {}}, handle)}\n"
              "serving._answer = _answer\ndef sort_copy(xs):\n    xs.clear()\n    return []\n")
    assert scores([
        (right, in_place), (right.replace("xs.sort()", "xs.reverse()"), in_place), (forged, compared),
    ]) == [1.0, 0.0, 0.0]


def test_tests_that_import_pytest():
    tests = ("import pytest\n\n@pytest.fixture\ndef three():\n    yield 3\n\n"
             "@pytest.mark.parametrize('x, y', [(3, 1.0), pytest.param(6, 2.0)])\ndef test_third(x, y, three):\n"
             "    assert third(x) == pytest.approx(y)\n    assert third(three) == pytest.approx(1.0)\n\n"
             "def test_negative():\n    with pytest.raises(ValueError, match='negative'):\n        third(-1)\n")
    right = "def third(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x / 3\n"
    assert scores([(right, tests), (right.replace("x / 3", "x / 2"), tests),
                   (right.replace("raise ValueError('negative')", "return 0"), tests)]) == [1.0, 0.0, 0.0]


def test_instances_of_the_programs_own_class_compare_by_their_state():
    tests = ("assert midpoint(Point(0, 0), Point(2, 4)) == Point(1, 2)\nassert Point(1, 2) != Point(2, 1)\n"
             "assert len({Point(1, 2), Point(1, 2)}) == 1\n")
    point = ("class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
             "    def __eq__(self, other):\n        return (self.x, self.y) == (other.x, other.y)\n"
             "    def __hash__(self):\n        return hash((self.x, self.y))\n")
    right = point + "def midpoint(a, b):\n    return Point((a.x + b.x) // 2, (a.y + b.y) // 2)\n"
    # the program's `__eq__` is never asked: one that says True to everything decides nothing
    always = right.replace("return (self.x, self.y) == (other.x, other.y)", "return True").replace(
        "// 2, (a.y", "// 3, (a.y")
    # a class the task defines compares with the task's `__eq__`, reading the program's object
    prompt = f"Write make_point with this class:\n```python\n{point}```"
    made = "assert make_point(1, 2) == Point(1, 2)\n"
    assert scores([(right, tests), (always, tests),
                   (point + "def make_point(a, b):\n    return Point(a, b)\n", made, prompt),
                   (point + "def make_point(a, b):\n    return Point(b, a)\n", made, prompt)]) == [1.0, 0.0, 1.0, 0.0]


def test_a_tuple_equals_the_expected_list():
    tests = "assert pair(1) == [1, 2]\nassert [pair(1), pair(2)] == [[1, 2], [2, 3]]\nassert pair(1) == (1, 2)\n"
    right = "def pair(x):\n    return (x, x + 1)\n"
    assert scores([(right, tests), (right.replace("x + 1", "x"), tests)]) == [1.0, 0.0]
