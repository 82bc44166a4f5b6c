"""Rewards of the user's own, named `module:function`: loading, results, validate, and errors that
name the function."""
import math
import sys
import textwrap

import pytest

from dare_core.rewards import RewardError, RewardResult, check_ground_truth, compute_reward, get_reward, user

MODULE = '''
from pathlib import Path

with open({log!r}, "a") as f:  # one line per execution of the module body
    f.write("imported\\n")

NOT_A_FUNCTION = 3


def as_float(completion, ground_truth, row):
    return 1.0 if completion.strip() == ground_truth else 0.25


def as_dict(completion, ground_truth, row, bonus=0.0):
    return {{"score": 0.5 + bonus, "acc": 0.0, "pred": completion.upper(), "seen_task": row.get("task")}}


def score_only(completion, ground_truth, row):
    return {{"score": 2, "pred": 7}}


def digits(completion, ground_truth, row):
    return float(completion == ground_truth)


def _only_digits(ground_truth):
    if not ground_truth.isdigit():
        raise ValueError(f"{{ground_truth!r}} is not digits")


digits.validate = _only_digits


def picky(completion, ground_truth, row):
    return 1.0


picky.validate = lambda ground_truth: ground_truth == "ok"


def boom(completion, ground_truth, row):
    raise RuntimeError("kaput")


def text(completion, ground_truth, row):
    return "1.0"


def nan(completion, ground_truth, row):
    return float("nan")


def no_score(completion, ground_truth, row):
    return {{"acc": 1.0}}


def two_args(completion, ground_truth):
    return 1.0


def needs_threshold(completion, ground_truth, row, *, threshold):
    return float(len(completion) > threshold)
'''


@pytest.fixture
def mod(tmp_path, user_module):
    """A fresh user module on sys.path; its name. Its imports are counted in imports.log."""
    return user_module(MODULE.format(log=str(tmp_path / "imports.log")))


def imports(tmp_path):
    return (tmp_path / "imports.log").read_text().count("imported")


def test_float_return_is_score_and_acc(mod):
    assert compute_reward(f"{mod}:as_float", " 42 ", "42") == RewardResult(1.0, 1.0, None, {})
    assert compute_reward(f"{mod}:as_float", "41", "42") == RewardResult(0.25, 0.25, None, {})


def test_dict_return_with_options_and_the_row(mod):
    row = {"uid": "u1", "task": "quiz", "ground_truth": "x"}
    result = compute_reward(f"{mod}:as_dict", "yes", "x", {"row": row}, args={"bonus": 0.25})
    assert result == RewardResult(0.75, 0.0, "YES", {"seen_task": "quiz"})
    # acc defaults to the score; pred is text
    assert compute_reward(f"{mod}:score_only", "a", "b") == RewardResult(2.0, 2.0, "7", {})


def test_unknown_option_lists_the_functions_options(mod):
    with pytest.raises(RewardError, match=rf"reward '{mod}:as_dict': unknown option\(s\) 'malus'; its options: bonus"):
        get_reward(f"{mod}:as_dict", {"malus": 1})
    with pytest.raises(RewardError, match=rf"reward '{mod}:needs_threshold': must take"):
        get_reward(f"{mod}:needs_threshold")
    assert compute_reward(f"{mod}:needs_threshold", "abcd", "", args={"threshold": 3}).score == 1.0


def test_imported_once_per_process(mod, tmp_path):
    # once here (its checks) and once in the process that runs it under the time limit (user_host.py)
    assert compute_reward(f"{mod}:as_float", "1", "1").score == 1.0
    sys.modules.pop(mod)  # only the reward's own cache can now spare a second import
    assert compute_reward(f"{mod}:as_float", "1", "2").score == 0.25
    check_ground_truth(f"{mod}:as_float", "anything")
    assert imports(tmp_path) == 2
    get_reward(f"{mod}:as_dict")  # another function of the module: one more import, as sys.modules lost it
    assert imports(tmp_path) == 3


def test_validate_attribute_is_the_ground_truth_check(mod):
    check_ground_truth(f"{mod}:digits", "123")
    with pytest.raises(ValueError, match=rf"reward '{mod}:digits': '12a' is not digits"):
        check_ground_truth(f"{mod}:digits", "12a")
    check_ground_truth(f"{mod}:picky", "ok")
    with pytest.raises(ValueError, match=rf"reward '{mod}:picky': validate rejected ground truth 'no'"):
        check_ground_truth(f"{mod}:picky", "no")
    check_ground_truth(f"{mod}:as_float", "")  # no validate: every ground truth


@pytest.mark.parametrize("function, problem", [
    ("boom", r"raised RuntimeError on row r7: kaput"),
    ("text", r"returned '1.0' \(str\) on row r7; expected a number or a dict with 'score'"),
    ("nan", r"returned a non-finite score nan on row r7"),
    ("no_score", r"returned a dict without 'score' \(keys: \['acc'\]\) on row r7"),
])
def test_scoring_errors_name_the_function_and_row(mod, function, problem):
    with pytest.raises(RewardError, match=rf"reward '{mod}:{function}' {problem}"):
        compute_reward(f"{mod}:{function}", "x", "y", {"row": {"uid": "r7"}})


def test_error_of_a_row_without_uid(mod):
    with pytest.raises(RewardError, match=rf"reward '{mod}:boom' raised RuntimeError: kaput"):
        compute_reward(f"{mod}:boom", "x", "y")


@pytest.mark.parametrize("reference, problem", [
    ("no_such_module_3f9a:score", "module 'no_such_module_3f9a' is not importable"),
    ("{mod}:missing", r"{mod} has no attribute 'missing' \(module file: .*{mod}.py\)"),
    ("{mod}:as_float.nested", "{mod}.as_float has no attribute 'nested'"),
    ("{mod}:NOT_A_FUNCTION", "is not a function but int 3"),
    ("{mod}:two_args", r"must take \(completion, ground_truth, row, \*\*options\)"),
    ("{mod}:", "expected module:function"),
])
def test_loading_errors_name_the_function(mod, reference, problem):
    reference, problem = reference.format(mod=mod), problem.format(mod=mod)
    with pytest.raises(RewardError, match=rf"reward '{reference}': {problem}"):
        get_reward(reference)


@pytest.mark.parametrize("name, source, problem", [
    ("broken_rewards_81c2", "import json\nraise KeyError('setup')\n", "failed: KeyError: 'setup'"),
    # SystemExit is no Exception: it ended the stage with exit 3 and no word
    ("exiting_rewards_81c2", "import sys\nsys.exit(3)\n", r"called sys.exit\(3\)"),
])
def test_module_that_fails_to_import(tmp_path, monkeypatch, name, source, problem):
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=rf"reward '{name}:score': importing {name} {problem}"):
        get_reward(f"{name}:score")
    sys.modules.pop(name, None)


def test_imported_from_the_current_directory(tmp_path, monkeypatch):
    """Stages run from the repository root, where a console script's sys.path does not look."""
    (tmp_path / "cwd_rewards_5d1e.py").write_text(textwrap.dedent('''
        def score(completion, ground_truth, row):
            return 0.5
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setattr(user, "_LOADED", {})
    try:
        assert compute_reward("cwd_rewards_5d1e:score", "a", "b").score == 0.5
        assert str(tmp_path) in sys.path
    finally:
        sys.modules.pop("cwd_rewards_5d1e", None)


def test_results_are_finite_floats(mod):
    result = compute_reward(f"{mod}:score_only", "a", "b")
    assert type(result.score) is float and math.isfinite(result.score)
