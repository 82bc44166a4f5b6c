import pytest

from dare_core.rewards import compute_reward
from dare_core.rewards.countdown import evaluate, format_ground_truth, parse_ground_truth
from dare_core.rewards.gsm8k import d1_components


# ---- gsm8k ----

def test_gsm8k_hash_commas_vs_box():
    result = compute_reward("gsm8k", r"... so she pays \boxed{1234} dollars", "Step one. #### 1,234")
    assert (result.score, result.acc, result.pred) == (1.0, 1.0, "1234")


def test_gsm8k_box_that_is_not_a_plain_number_uses_the_math_path():
    result = compute_reward("gsm8k", r"\boxed{\frac{24}{2}}", "#### 12")
    assert result.score == 1.0 and result.extra["equivalence"] == "number"
    assert compute_reward("gsm8k", r"\boxed{12 \text{ apples}}", "#### 12").score == 1.0
    assert compute_reward("gsm8k", r"\boxed{\frac{25}{2}}", "#### 12").score == 0.0


@pytest.mark.parametrize("text, truth, parts, total", [
    ("<reasoning>\n3+4=7\n</reasoning>\n<answer>\n7\n</answer>\n", "#### 7",
     {"correctness": 2.0, "integer": 0.5, "strict_format": 0.5, "soft_format": 0.5, "xml_count": 0.5}, 4.0),
    # comma in the tag: no exact match, not an integer; soft format only; 8 characters after the tag
    ("<reasoning>think</reasoning> <answer>1,234</answer> thanks!", "#### 1,234",
     {"correctness": 0.0, "integer": 0.0, "strict_format": 0.0, "soft_format": 0.5, "xml_count": -0.008}, 0.492),
    # well-formed and right, but 5 characters trail the closing tag: not strict
    ("<reasoning>\nx\n</reasoning>\n<answer>\n12\n</answer>\nextra", "#### 12",
     {"correctness": 2.0, "integer": 0.5, "strict_format": 0.0, "soft_format": 0.5, "xml_count": 0.495}, 3.495),
])
def test_gsm8k_d1_hand_computed(text, truth, parts, total):
    assert d1_components(text, truth) == pytest.approx(parts)
    result = compute_reward("gsm8k_d1", text, truth)
    assert result.score == pytest.approx(total)
    assert result.acc == (1.0 if parts["correctness"] else 0.0)


def test_gsm8k_d1_without_tag():
    result = compute_reward("gsm8k_d1", "The answer is 12.", "#### 12")
    assert (result.score, result.acc, result.pred) == (0.0, 0.0, None)
    assert result.extra["extraction_failed"]


# ---- countdown ----

@pytest.mark.parametrize("response, score", [
    ("<answer>(1+2)*3</answer>", 1.0),
    ("thinking... <answer>1+2</answer> no: <answer> 3 * (2 + 1) </answer>", 1.0),  # the last tag
    ("<answer>1+2+3</answer>", 0.1),  # right numbers, wrong value
    ("<answer>3*3</answer>", 0.1),  # a reused number and a missing one
    ("<answer>(1+2)*3*1</answer>", 0.1),  # an extra number
    ("(1+2)*3", 0.0),  # no tag
    ("<answer></answer>", 0.0),
    ("<answer>3**2*1</answer>", 0.1),  # no powers: huge exponents are impossible
    ("<answer>(1 2)*3</answer>", 0.1),
])
def test_countdown(response, score):
    assert compute_reward("countdown", response, "9|1,2,3").score == score


def test_countdown_never_evaluates_code(tmp_path):
    marker = tmp_path / "ran"
    attack = f"<answer>__import__('os').system('touch {marker}')</answer>"
    result = compute_reward("countdown", attack, "9|1,2,3")
    assert (result.score, result.acc) == (0.1, 0.0)
    assert not marker.exists()
    assert evaluate("__import__('os')") is None and evaluate("1" + "+1" * 300) is None


def test_countdown_division_by_zero_and_fractions():
    assert evaluate("3/(1-1)") is None
    assert compute_reward("countdown", "<answer>6/(1-1)</answer>", "8|6,1,1").score == 0.1
    # exact arithmetic: 6/(1-1/4) = 8 reached through a fraction
    assert compute_reward("countdown", "<answer>6/(1-1/4)</answer>", "8|6,1,1,4").score == 1.0


def test_countdown_plain_format_and_ground_truth():
    assert parse_ground_truth("9|1,2,3") == (9, [1, 2, 3], "tag")
    assert format_ground_truth(9, [1, 2, 3], "plain") == "9|1,2,3|plain"
    assert compute_reward("countdown", " (1+2)*3\n", "9|1,2,3|plain").score == 1.0
    # plain: the whole response is the answer, so a tag is not the requested format
    assert compute_reward("countdown", "<answer>(1+2)*3</answer>", "9|1,2,3|plain").score == 0.1
    with pytest.raises(ValueError, match="target"):
        parse_ground_truth("9")


# ---- sudoku ----

PUZZLE = "1000341021004300"  # 8 empty cells
SOLUTION = "1234341221434321"


def test_sudoku_half_correct_scores_half():
    answer = list(SOLUTION)
    empty = [i for i, c in enumerate(PUZZLE) if c == "0"]
    for i in empty[:4]:
        answer[i] = "1" if SOLUTION[i] != "1" else "2"
    result = compute_reward("sudoku", f"<answer>{''.join(answer)}</answer>", f"{PUZZLE}|{SOLUTION}")
    assert (result.score, result.acc) == (0.5, 0.0)


def test_sudoku_full_truncated_padded_and_formats():
    truth = f"{PUZZLE}|{SOLUTION}"
    assert compute_reward("sudoku", f"<answer>{SOLUTION}</answer>", truth).acc == 1.0
    # extra digits are truncated; spaces and newlines between digits do not matter
    spaced = " ".join(SOLUTION[:8]) + "\n" + SOLUTION[8:] + "9999"
    assert compute_reward("sudoku", f"<answer>{spaced}</answer>", truth).score == 1.0
    # short answers are padded with 0: the last two empty cells (14, 15) count as wrong
    assert compute_reward("sudoku", f"<answer>{SOLUTION[:14]}</answer>", truth).score == 0.75
    assert compute_reward("sudoku", SOLUTION, truth).extra == {"extraction_failed": True}
    assert compute_reward("sudoku", SOLUTION, truth + "|plain").score == 1.0
    with pytest.raises(ValueError, match="puzzle"):
        compute_reward("sudoku", SOLUTION, "123|456")
