import pytest

from dare_core.data.tasks import TASKS, get_task


def test_unknown_task_lists_known():
    with pytest.raises(ValueError, match="arithmetic"):
        get_task("nope")


def test_arithmetic_is_seeded_and_correct():
    task = get_task("arithmetic")
    assert "arithmetic" in TASKS and task.reward == "arithmetic"
    rows = task.generate(200, seed=3, min_digits=1, max_digits=2, ops="+-*")
    assert rows == task.generate(200, seed=3, min_digits=1, max_digits=2, ops="+-*")
    assert rows != task.generate(200, seed=4, min_digits=1, max_digits=2, ops="+-*")
    for row in rows:
        assert row.keys() == {"prompt", "response", "ground_truth", "task"}
        expression = row["prompt"].removesuffix("=")
        assert str(eval(expression)) == row["response"] == row["ground_truth"]
        assert int(row["response"]) >= 0  # subtraction keeps a >= b
        assert all(1 <= len(x) <= 2 for x in expression.replace("-", "+").replace("*", "+").split("+"))


def test_arithmetic_does_not_touch_global_rng():
    import random

    random.seed(0)
    before = random.random()
    random.seed(0)
    get_task("arithmetic").generate(10, seed=1)
    assert random.random() == before


def test_arithmetic_counts_and_rejects_bad_args():
    task = get_task("arithmetic")
    assert task.num_distinct(min_digits=1, max_digits=1, ops="+") == 100
    assert task.num_distinct(min_digits=1, max_digits=1, ops="+-") == 155
    with pytest.raises(ValueError, match="ops"):
        task.generate(1, seed=0, ops="/")
    with pytest.raises(ValueError, match="min_digits"):
        task.generate(1, seed=0, min_digits=3, max_digits=2)
