import time

import pytest

from dare_core.rewards import REWARDS, compute_reward, math as math_reward
from dare_core.rewards.extract import last_boxed, unwrap_boxed
from dare_core.rewards.math import as_rational, math_equal, normalize_answer


def test_registered():
    assert {"math", "gsm8k", "gsm8k_d1", "countdown", "sudoku", "code"} <= set(REWARDS)


@pytest.mark.parametrize("response, truth", [
    (r"so \boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}"),
    (r"\boxed{x^{2}}", "x^2"),
    (r"\boxed{10\text{ cm}}", "10"),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)"),
    (r"\boxed{x = 3}", "3"),
    (r"\boxed{1,234}", "1234"),
    (r"\fbox{-\frac{3}{4}}", "-0.75"),
    (r"\boxed{42}", r"The answer is $\boxed{42}$."),  # a boxed ground truth is unwrapped
])
def test_equivalent_answers_score_one_in_process(response, truth):
    result = compute_reward("math", response, truth)
    assert (result.score, result.acc) == (1.0, 1.0)
    assert result.extra["method"] in ("string", "number")  # decided without the worker


def test_nested_braces_extracted_whole_and_graded():
    response = r"first \boxed{1}, finally \boxed{\frac{a}{\sqrt{b}}}"
    assert last_boxed(response) == r"\frac{a}{\sqrt{b}}"
    result = compute_reward("math", response, r"\frac{a\sqrt{b}}{b}")
    assert result.pred == r"\frac{a}{\sqrt{b}}"
    assert result.score == 1.0 and result.extra["method"] in ("math_verify", "sympy")


def test_last_of_two_boxes():
    response = r"maybe \boxed{3}? no: \boxed{5}"
    assert compute_reward("math", response, "5").score == 1.0
    assert compute_reward("math", response, "3").score == 0.0


def test_no_box_scores_zero():
    result = compute_reward("math", "the answer is 5", "5")
    assert (result.score, result.acc, result.pred) == (0.0, 0.0, None)
    assert result.extra == {"extraction_failed": True}


def test_wrong_answers_score_zero():
    assert compute_reward("math", r"\boxed{0.51}", r"\frac{1}{2}").score == 0.0
    assert compute_reward("math", r"\boxed{x^3}", "x^2").score == 0.0
    assert compute_reward("math", r"\boxed{}", "1").score == 0.0


def test_symbolic_equivalence_uses_the_worker():
    equal, method = math_equal("x^2+2x+1", "(x+1)^2")
    assert equal and method in ("math_verify", "sympy")
    assert math_equal(r"2\sqrt{2}", r"\sqrt{8}")[0]
    assert not math_equal("x^2+2x", "(x+1)^2")[0]


def test_pathological_input_times_out_with_zero():
    assert math_equal("y+y", "2y")[0]  # the worker is up: its start-up is not part of the limit
    started = time.monotonic()
    result = compute_reward("math", r"\boxed{10^{10^{10^{10}}}}", "1", {"timeout": 1.0})
    elapsed = time.monotonic() - started
    assert (result.score, result.extra.get("timeout")) == (0.0, True)
    assert elapsed < 2.5
    assert math_equal("y+y", "2y")[0]  # a fresh worker answers the next call


def test_normalisation_helpers():
    assert normalize_answer(r"\left(\dfrac{1}{2}\right)") == r"(\frac{1}{2})"
    assert normalize_answer(r"$\sqrt2$") == r"\sqrt{2}"
    assert normalize_answer(r"90^\circ") == "90"
    assert normalize_answer("3/4") == r"\frac{3}{4}"
    assert normalize_answer(".5") == "0.5"
    assert as_rational(r"\frac{6}{8}") == as_rational("0.75")
    assert as_rational(normalize_answer("3/4")) == as_rational("0.75")
    assert as_rational("1e9") is None and as_rational("9" * 100) is None
    assert unwrap_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}" and unwrap_boxed(" 7 ") == "7"


def test_sympy_fallback_without_math_verify(monkeypatch, tmp_path):
    monkeypatch.setenv("DARE_MATH_VERIFY", "0")
    worker = math_reward._EquivalenceWorker()
    try:
        def ask(pred, gold):
            return worker.check({"pred": pred, "gold": gold, "pred_norm": normalize_answer(pred),
                                 "gold_norm": normalize_answer(gold), "timeout": 5}, 30.0)

        assert ask("x^2+2x+1", "(x+1)^2") == {"equal": True, "method": "sympy"}
        assert ask(r"\frac{a}{\sqrt{b}}", r"\frac{a\sqrt{b}}{b}")["equal"]
        assert worker.math_verify is False
        # too many unknown letters, or anything beyond arithmetic: not handed to SymPy at all
        assert ask("a+b+c", "c+b+a")["method"] == "unparsed"
        marker = tmp_path / "ran"
        attack = f"__import__('os').system('touch {marker}')"
        assert ask(attack, "0") == {"equal": False, "method": "unparsed"}
        assert not marker.exists()
    finally:
        worker.stop()
