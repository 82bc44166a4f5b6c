import pytest

from dare_core.data.synthetic import TASKS, get_task


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


def test_zero_pad_and_imperfect_demonstrations():
    task = get_task("arithmetic")
    rows = task.generate(2000, seed=5, min_digits=1, max_digits=3, zero_pad=True, demo_error_rate=0.5)
    clean = task.generate(2000, seed=5, min_digits=1, max_digits=3, zero_pad=True)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in clean]  # same problems
    wrong = 0
    for r in rows:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert len(a) == len(b) == 3 and len(r["response"]) == len(r["ground_truth"]) == 4
        assert int(r["ground_truth"]) == int(a) + int(b)
        if r["response"] != r["ground_truth"]:
            wrong += 1
            assert int(a) % 10 + int(b) % 10 >= 10  # only a carried ones column is ever botched
            assert int(r["response"]) == int(r["ground_truth"]) - 10
    carries = sum(int(r["prompt"][2]) + int(r["prompt"][6]) >= 10 for r in rows)
    assert abs(wrong / carries - 0.5) < 0.06
