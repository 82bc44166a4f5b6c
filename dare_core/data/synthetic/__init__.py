"""Seeded synthetic tasks: a registry of generators for the embedded default and for tests.

A task is a class with `name`, `reward` (the reward it is graded with), and
`generate(n, seed, **task_args) -> list[dict]` returning rows with `prompt` (the user message, which
tells the model the answer format), `response` (the SFT target), `ground_truth` (what the reward
compares against) and `task`. It may also define `num_distinct(**task_args) -> int | None`, the number
of different problems it can produce, so data preparation can say why a split cannot be filled.
Generation draws only from `random.Random(seed)`, never from the global RNG.
"""
from dare_core.data.synthetic import arithmetic, countdown, sudoku  # noqa: F401  (registration)
from dare_core.data.synthetic.registry import TASKS, get_task, register_task

__all__ = ["TASKS", "get_task", "register_task"]
