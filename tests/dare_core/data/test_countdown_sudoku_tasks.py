import random

import pytest

from dare_core.data.synthetic import TASKS, get_task
from dare_core.data.synthetic.countdown import reachable
from dare_core.data.synthetic.sudoku import all_solutions, count_solutions, is_valid_solution
from dare_core.rewards import compute_reward
from dare_core.rewards.countdown import evaluate, parse_ground_truth


@pytest.mark.parametrize("name, args", [
    ("countdown", {}),
    ("countdown", {"num_numbers": 4, "max_number": 12, "ops": "+-*", "max_target": 50}),
    ("countdown", {"answer_format": "plain", "instruction": False}),
    ("sudoku", {}),
    ("sudoku", {"num_blanks": 12, "answer_format": "plain", "instruction": False}),
])
def test_seeded_and_every_demonstration_scores_one(name, args):
    task = get_task(name)
    assert name in TASKS and task.reward == name
    rows = task.generate(300, seed=7, **args)
    assert rows == task.generate(300, seed=7, **args)
    assert rows != task.generate(300, seed=8, **args)
    for row in rows:
        assert row.keys() == {"prompt", "response", "ground_truth", "task"} and row["task"] == name
        result = compute_reward(task.reward, row["response"], row["ground_truth"], {"task": name})
        assert (result.score, result.acc) == (1.0, 1.0), row


def test_generation_does_not_touch_global_rng():
    random.seed(0)
    before = random.random()
    random.seed(0)
    get_task("countdown").generate(20, seed=1)
    get_task("sudoku").generate(20, seed=1)
    assert random.random() == before


def test_countdown_targets_are_reachable_with_each_number_once():
    rows = get_task("countdown").generate(200, seed=3, num_numbers=3, max_target=60)
    for row in rows:
        target, numbers, answer_format = parse_ground_truth(row["ground_truth"])
        assert answer_format == "tag" and 1 <= target <= 60 and all(1 <= n <= 9 for n in numbers)
        assert row["prompt"].startswith(f"{' '.join(map(str, numbers))} -> {target}\n")
        assert "<answer>" in row["prompt"]
        expression = row["response"].removeprefix("<answer>").removesuffix("</answer>")
        assert evaluate(expression) == target
        assert sorted(int(t) for t in expression.replace("(", " ").replace(")", " ").replace("+", " ")
                      .replace("-", " ").replace("*", " ").replace("/", " ").split()) == sorted(numbers)
        assert target in reachable(tuple(numbers), "+-*/")


def test_countdown_terse_format_and_counts():
    task = get_task("countdown")
    row = task.generate(1, seed=0, answer_format="plain", instruction=False)[0]
    assert "\n" not in row["prompt"] and row["ground_truth"].endswith("|plain")
    assert "<" not in row["response"] and len(row["response"]) <= 11  # fits a small canvas
    # 2 numbers from 1..2 with + only: (1,1)->2, (1,2)->3, (2,1)->3, (2,2)->4
    assert task.num_distinct(num_numbers=2, min_number=1, max_number=2, ops="+") == 4
    found = reachable((1, 2), "+-*/")  # 1-2 < 0 and 1/2 are not integers: not intermediate values
    assert sorted(found) == [1, 2, 3] and all(evaluate(text) == value for value, text in found.items())
    with pytest.raises(ValueError, match="ops"):
        task.generate(1, seed=0, ops="^")
    with pytest.raises(ValueError, match="answer_format"):
        task.generate(1, seed=0, answer_format="xml")


def test_sudoku_solutions_valid_and_unique():
    assert len(all_solutions()) == 288 and all(is_valid_solution(g) for g in all_solutions())
    rows = get_task("sudoku").generate(200, seed=5, num_blanks=8)
    for row in rows:
        puzzle, solution = row["ground_truth"].split("|")
        assert row["prompt"].split("\n")[0] == puzzle and row["response"] == f"<answer>{solution}</answer>"
        assert puzzle.count("0") == 8 and is_valid_solution(solution)
        assert all(p in ("0", s) for p, s in zip(puzzle, solution))
        assert count_solutions(puzzle) == 1
    with pytest.raises(ValueError, match="num_blanks"):
        get_task("sudoku").generate(1, seed=0, num_blanks=13)
