"""The task-agnostic built-in rewards (exact_match, regex_match, numeric, choice), their options and
ground-truth checks."""
import pytest

from dare_core.rewards import RewardError, RewardResult, check_ground_truth, compute_reward, get_reward
from dare_core.rewards.regex_match import MAX_RESPONSE_CHARS


def hit(pred):
    return RewardResult(1.0, 1.0, pred, {})


def miss(pred):
    return RewardResult(0.0, 0.0, pred, {})


FAILED = RewardResult(0.0, 0.0, None, {"extraction_failed": True})


# ---- exact_match ----

@pytest.mark.parametrize("response, truth, args, expected", [
    ("1225", "1225", {}, hit("1225")),
    ("  1225\n", "1225", {}, hit("1225")),
    ("+1225", "01225", {}, miss("+1225")),  # no number parsing: a different string
    ("+1225", "1225", {}, miss("+1225")),
    ("  1225", "1225", {"strip": False}, miss("  1225")),
    ("Paris", "paris", {}, miss("Paris")),
    ("Paris", "paris", {"case": False}, hit("paris")),
    ("New   York\tCity", "New York City", {}, miss("New   York\tCity")),
    ("New   York\tCity", "New York City", {"whitespace": "collapse"}, hit("New York City")),
    ("N e w York", "NewYork", {"whitespace": "remove"}, hit("NewYork")),
    ("NEW  york", "new york", {"case": False, "whitespace": "collapse"}, hit("new york")),
    ("   ", "x", {}, FAILED),
])
def test_exact_match(response, truth, args, expected):
    assert compute_reward("exact_match", response, truth, args=args) == expected


def test_exact_match_ground_truth_check_uses_the_options():
    check_ground_truth("exact_match", " x ")
    with pytest.raises(ValueError, match="exact_match reward: ground truth '  ' is empty after normalisation"):
        check_ground_truth("exact_match", "  ")
    # not empty when kept as is
    check_ground_truth("exact_match", "  ", {"strip": False})
    with pytest.raises(ValueError, match="empty after normalisation"):
        check_ground_truth("exact_match", " \t", {"strip": False, "whitespace": "remove"})


@pytest.mark.parametrize("args, problem", [({"whitespace": "squash"}, "option whitespace must be one of"),
                                           ({"case": "false"}, "option case must be true or false")])
def test_exact_match_bad_option_value(args, problem):
    with pytest.raises(RewardError, match=problem):
        check_ground_truth("exact_match", "x", args)


# ---- regex_match ----

@pytest.mark.parametrize("response, truth, args, expected", [
    ("  cat\n", r"c.t", {}, hit("cat")),
    ("the cat", r"c.t", {}, miss("the cat")),  # fullmatch, not search
    ("CAT", r"cat", {}, miss("CAT")),
    ("CAT", r"cat", {"flags": "i"}, hit("CAT")),
    ("a\nb", r"a.b", {}, miss("a\nb")),
    ("a\nb", r"a.b", {"flags": "s"}, hit("a\nb")),
    ("A\nB", r"a.b", {"flags": "is"}, hit("A\nB")),
    ("", r"x*", {}, FAILED),
])
def test_regex_match(response, truth, args, expected):
    assert compute_reward("regex_match", response, truth, args=args) == expected


def test_regex_match_long_response_scores_zero_unread():
    result = compute_reward("regex_match", "a" * (MAX_RESPONSE_CHARS + 1), "a+")
    assert result == RewardResult(0.0, 0.0, None, {"too_long": True})
    assert compute_reward("regex_match", "a" * MAX_RESPONSE_CHARS, "a+").score == 1.0


def test_regex_match_checks():
    check_ground_truth("regex_match", r"\d+")
    with pytest.raises(ValueError, match=r"regex_match reward: ground truth '\(ab' is not a regular expression"):
        check_ground_truth("regex_match", "(ab")
    with pytest.raises(RewardError, match="unknown flag 'q'"):
        check_ground_truth("regex_match", "ab", {"flags": "iq"})


# ---- numeric ----

@pytest.mark.parametrize("response, truth, args, expected", [
    ("so the total is 1,234.5 dollars", "1234.5", {}, hit("1234.5")),
    ("1234.5", "1,234.5", {}, hit("1234.5")),
    ("first 7, then 42", "42", {}, hit("42")),  # the last number
    ("42, no wait, 41", "42", {}, miss("41")),
    ("x = -3.5", "-3.5", {}, hit("-3.5")),
    ("3-5", "5", {}, hit("5")),  # a minus after a digit is not a sign
    ("about 1.5e3 km", "1500", {}, hit("1.5e3")),
    ("2.5E-2", "0.025", {}, hit("2.5E-2")),
    ("+7", "7", {}, hit("+7")),
    ("It is 5.", "5", {}, hit("5")),
    ("0.1", "0.1000000001", {}, hit("0.1")),  # within abs_tol 1e-9
    ("0.1", "0.100000002", {}, miss("0.1")),
    ("0.1", "0.100000002", {"abs_tol": 1e-6}, hit("0.1")),
    ("100", "101", {}, miss("100")),
    ("100", "101", {"rel_tol": 0.01, "abs_tol": 0}, hit("100")),
    ("100", "102", {"rel_tol": 0.01, "abs_tol": 0}, miss("100")),
    ("12345678901234567891", "12345678901234567892", {}, miss("12345678901234567891")),  # no float blur
    ("no digits here", "3", {}, FAILED),
])
def test_numeric(response, truth, args, expected):
    assert compute_reward("numeric", response, truth, args=args) == expected


def test_numeric_checks():
    check_ground_truth("numeric", " -1,234.5e2 ")
    for bad in ("12 apples", "1 2", "#### 5", "five"):
        with pytest.raises(ValueError, match=f"numeric reward: ground truth '{bad}' is not one number"):
            check_ground_truth("numeric", bad)
    with pytest.raises(RewardError, match="option abs_tol must be a number >= 0, got -1"):
        check_ground_truth("numeric", "1", {"abs_tol": -1})


# ---- choice ----

@pytest.mark.parametrize("response, expected", [
    ("B", hit("B")),
    (" b ", hit("B")),
    ("(B)", hit("B")),
    ("B.", hit("B")),
    ("**B**", hit("B")),
    ("Answer: B", hit("B")),
    ("the answer is B because it is blue", hit("B")),
    ("The correct answer is (B).", hit("B")),
    ("B. Paris, the capital", hit("B")),
    ("(A) is tempting, but the answer is B", hit("B")),  # the statement wins over the leading letter
    ("Answer: C", miss("C")),
    ("A) first option", miss("A")),
    ("the answer is a tricky one", FAILED),  # an article, not option A
    ("I am not sure", FAILED),
])
def test_choice_extraction(response, expected):
    assert compute_reward("choice", response, "B") == expected


def test_choice_letters_option():
    assert compute_reward("choice", "Answer: E", "B", args={"letters": "ABCD"}) == FAILED
    assert compute_reward("choice", "Answer: E", "E", args={"letters": "ABCDE"}) == hit("E")
    check_ground_truth("choice", "c", {"letters": "ABCD"})
    with pytest.raises(ValueError, match="choice reward: ground truth 'E' is not one of the option letters 'ABCD'"):
        check_ground_truth("choice", "E", {"letters": "ABCD"})
    with pytest.raises(ValueError, match="ground truth 'AB' is not one of the option letters"):
        check_ground_truth("choice", "AB")
    with pytest.raises(RewardError, match="option letters must be distinct uppercase letters"):
        check_ground_truth("choice", "A", {"letters": "abcd"})


# ---- options ----

def test_unknown_option_names_reward_and_lists_its_options():
    with pytest.raises(RewardError, match=r"reward 'exact_match': unknown option\(s\) 'lower'; "
                                          r"its options: case, strip, whitespace"):
        get_reward("exact_match", {"lower": True})
    with pytest.raises(RewardError, match=r"reward 'arithmetic': unknown option\(s\) 'x'; its options: none"):
        compute_reward("arithmetic", "1", "1", args={"x": 1})
    # the response and ground truth are not options
    with pytest.raises(RewardError, match="unknown option"):
        get_reward("numeric", {"ground_truth": "1"})


def test_no_options_is_the_plain_function():
    assert get_reward("numeric") is get_reward("numeric", {})
