import pytest

from dare_core.rewards import REWARDS, RewardResult, compute_reward, get_reward
from dare_core.rewards.gsm8k import last_boxed


def test_registry():
    assert {"arithmetic", "gsm8k"} <= set(REWARDS)
    with pytest.raises(ValueError, match="arithmetic"):
        get_reward("nope")


@pytest.mark.parametrize("response, score, pred", [(" 42\n", 1.0, "42"), ("41", 0.0, "41"), ("+42", 1.0, "+42")])
def test_arithmetic(response, score, pred):
    assert compute_reward("arithmetic", response, "42") == RewardResult(score, score, pred, {})


@pytest.mark.parametrize("response", ["forty-two", "", "42 apples", "4 2"])
def test_arithmetic_not_a_number(response):
    result = compute_reward("arithmetic", response, "42")
    assert (result.score, result.acc, result.pred) == (0.0, 0.0, None)
    assert result.extra == {"extraction_failed": True}


def test_gsm8k_boxed_vs_hash_with_commas():
    assert compute_reward("gsm8k", r"so the total is \boxed{1234}.", "He pays... #### 1,234").score == 1.0
    assert compute_reward("gsm8k", r"\boxed{\$1,234.}", "1234").score == 1.0


def test_last_boxed():
    assert last_boxed(r"x \boxed{\frac{a}{\sqrt{b}}} y") == r"\frac{a}{\sqrt{b}}"
    assert last_boxed(r"\boxed{1} then \fbox{2}") == "2"
    assert last_boxed(r"\boxed{1} then \boxed{2") == "1"  # an unbalanced last box is skipped
    assert last_boxed(r"\boxed 7$") == "7"
    assert last_boxed("no box") is None


def test_gsm8k_uses_last_box():
    result = compute_reward("gsm8k", r"\boxed{3} no wait \boxed{5}", "#### 5")
    assert (result.score, result.pred) == (1.0, "5")


def test_gsm8k_answer_tag_and_last_number():
    assert compute_reward("gsm8k", "<answer>7</answer> <answer> 42 </answer>", "#### 42").score == 1.0
    result = compute_reward("gsm8k", "3 apples plus 39 apples make 42 apples.", "#### 42")
    assert (result.score, result.extra["method"]) == (1.0, "last_number")


def test_gsm8k_garbage_scores_zero():
    result = compute_reward("gsm8k", "I do not know", "#### 42")
    assert (result.score, result.acc, result.pred) == (0.0, 0.0, None)
    assert result.extra["extraction_failed"]
    assert compute_reward("gsm8k", r"\boxed{forty}", "#### 40").score == 0.0
    assert compute_reward("gsm8k", "the answer is 41", "#### 42").score == 0.0
