"""Which reward grades a row (configured > the row's `reward` column > its task's), through
score_texts, the `task` benchmark and the ground-truth checks of prepared rows."""
import json

import pytest

from dare_core.config import ConfigError
from dare_core.data.schema import DataError, check_ground_truths, read_rows, write_rows
from dare_core.eval.configs.task import PreparedTask
from dare_core.rewards.scoring import reward_for, reward_name_for, score_texts

ROW = {"prompt": "p", "ground_truth": "42", "task": "arithmetic", "uid": "u0", "prompt_text": "p"}


def test_precedence_configured_then_row_column_then_task():
    plain, own = dict(ROW), dict(ROW, reward="numeric", reward_args=json.dumps({"abs_tol": 0.5}))
    text = "x 42.25"
    # the task's reward (arithmetic) needs the whole response to be the integer
    assert [(r.score, r.pred) for r in score_texts([plain], [text])] == [(0.0, None)]
    # the row's own reward and options: 42.25 is within 0.5 of 42
    assert [(r.score, r.pred) for r in score_texts([own], [text])] == [(1.0, "42.25")]
    # the configured reward wins over both, with the configured options
    configured = score_texts([plain, own], [text, text], "exact_match", {"case": False})
    assert [(r.score, r.pred) for r in configured] == [(0.0, "x 42.25"), (0.0, "x 42.25")]
    assert [r.score for r in score_texts([plain, own], ["42", "42"], "exact_match")] == [1.0, 1.0]


def test_reward_for_and_name():
    own = dict(ROW, reward="mypkg.rewards:score", reward_args='{"k": 1}')
    assert reward_for(own) == ("mypkg.rewards:score", {"k": 1})
    assert reward_name_for(own) == "mypkg.rewards:score"
    assert reward_name_for(own, "numeric") == "numeric"
    assert reward_for(ROW, "pkg:fn", {"a": 2}) == ("pkg:fn", {"a": 2})
    assert reward_for(ROW) == ("arithmetic", {})
    with pytest.raises(ValueError, match="row u0: column 'reward_args' must be a JSON object"):
        reward_for(dict(ROW, reward="numeric", reward_args="[1]"))


@pytest.fixture
def mod(user_module):
    return user_module(
        "def length(completion, ground_truth, row, scale=1.0):\n"
        "    return {'score': scale * len(completion), 'acc': float(completion == ground_truth), 'uid': row['uid']}\n"
        "def only_a(completion, ground_truth, row):\n"
        "    return 1.0\n"
        "only_a.validate = lambda ground_truth: ground_truth.startswith('a')\n")


def test_user_reward_gets_the_row_through_score_texts(mod):
    rows = [dict(ROW, reward=f"{mod}:length", reward_args='{"scale": 0.5}', uid="r1"), dict(ROW, uid="r2")]
    first, second = score_texts(rows, ["42", "4"])
    assert (first.score, first.acc, first.extra) == (1.0, 1.0, {"uid": "r1"})
    assert (second.score, second.pred) == (0.0, "4")  # arithmetic
    configured = score_texts(rows, ["abc", "abcd"], f"{mod}:length", {"scale": 2.0})
    assert [(r.score, r.extra["uid"]) for r in configured] == [(6.0, "r1"), (8.0, "r2")]


def test_task_benchmark_grades_with_the_rows_reward(tmp_path):
    rows = [dict(ROW, uid="e0", ground_truth="Paris", reward="exact_match", reward_args='{"case": false}'),
            dict(ROW, uid="e1", ground_truth="Paris", reward="exact_match"),
            dict(ROW, uid="e2", ground_truth="7")]
    write_rows(tmp_path / "eval.parquet", rows, "eval")
    assert [r.get("reward") for r in read_rows(tmp_path / "eval.parquet", "eval")] == ["exact_match", "exact_match", None]
    task = PreparedTask()
    loaded = task.load(tmp_path)
    assert [(r["reward"], r["reward_args"]) for r in loaded] == [("exact_match", '{"case": false}'),
                                                                  ("exact_match", None), (None, None)]
    # "Paris" is no integer: arithmetic, the task's reward, would reject it
    assert [task.grade(loaded[0], t) for t in (" PARIS ", "Lyon")] == [1.0, 0.0]
    assert task.grade(loaded[1], "PARIS") == 0.0  # case-sensitive without the row's options
    assert [task.grade(loaded[2], t) for t in ("7", "7.0")] == [1.0, 0.0]


def test_task_benchmark_rows_survive_an_opencompass_table(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [dict(ROW, uid="e0", ground_truth="b", reward="choice"), dict(ROW, uid="e1", ground_truth="3")]
    write_rows(tmp_path / "eval.parquet", rows, "eval")
    task = PreparedTask()
    table = datasets.Dataset.from_list(task.load(tmp_path))  # what DareDataset hands the evaluator
    assert [task.grade(dict(row), text) for row, text in zip(table, ["the answer is B", "3"])] == [1.0, 1.0]


def test_check_ground_truths_honours_the_rows_reward(mod):
    check_ground_truths([dict(ROW, ground_truth="Paris", reward="exact_match")], "auto", "f.parquet")
    with pytest.raises(DataError, match="f.parquet: row 1: column 'ground_truth': arithmetic reward"):
        check_ground_truths([dict(ROW, ground_truth="Paris")], "auto", "f.parquet")
    check_ground_truths([dict(ROW, ground_truth="abc", reward=f"{mod}:only_a")], "auto", "f.parquet")
    with pytest.raises(DataError, match=rf"f.parquet: row 2: column 'ground_truth': reward '{mod}:only_a': "
                                        "validate rejected ground truth 'xyz'"):
        check_ground_truths([dict(ROW, ground_truth="abc", reward=f"{mod}:only_a"),
                             dict(ROW, ground_truth="xyz", reward=f"{mod}:only_a")], "auto", "f.parquet")


@pytest.mark.parametrize("columns, problem", [
    ({"reward": "nope"}, r"row 1: column 'reward': unknown reward 'nope'"),
    ({"reward": "numeric", "reward_args": "{bad"}, r"row 1: column 'reward_args' is not JSON"),
    ({"reward": "numeric", "reward_args": '{"tol": 1}'}, r"row 1: reward 'numeric': unknown option\(s\) 'tol'"),
    ({"reward": "no_such_module_77:f"}, r"row 1: reward 'no_such_module_77:f': module 'no_such_module_77' is not"),
    ({"reward": "exact_match", "reward_args": '{"whitespace": "x"}'}, r"row 1: exact_match reward: option whitespace"),
])
def test_check_ground_truths_rejects_a_bad_row_reward(columns, problem):
    with pytest.raises(DataError, match=rf"f.parquet: {problem}"):
        check_ground_truths([dict(ROW, **columns)], "auto", "f.parquet")


def test_check_ground_truths_configured_reward(mod):
    check_ground_truths([dict(ROW, reward="nope")], "numeric", "f.parquet")  # the configured reward wins
    check_ground_truths([ROW], f"{mod}:length", "f.parquet", {"scale": 3})
    with pytest.raises(ConfigError, match=rf"rl.reward: reward '{mod}:length': unknown option\(s\) 'size'"):
        check_ground_truths([ROW], f"{mod}:length", "f.parquet", {"size": 3})
    with pytest.raises(ConfigError, match=r"rl.reward: reward 'gone_module_12:f': module 'gone_module_12' is not"):
        check_ground_truths([ROW], "gone_module_12:f", "f.parquet")
    with pytest.raises(ConfigError, match=r"rl.reward: unknown reward 'nope'"):
        check_ground_truths([ROW], "nope", "f.parquet")
    with pytest.raises(ConfigError, match=r"rl.reward: regex_match reward: unknown flag 'z' .* \(at f.parquet: row 1\)"):
        check_ground_truths([ROW], "regex_match", "f.parquet", {"flags": "z"})


def test_reward_args_need_a_named_reward():
    from dare_core.config import FieldError, RLConfig

    assert RLConfig(reward="exact_match", reward_args={"case": False}).reward_args == {"case": False}
    assert RLConfig().reward_args == {}
    with pytest.raises(FieldError, match=r"reward_args needs rl.reward set to a reward, not auto"):
        RLConfig(reward_args={"case": False})
