"""Seeded synthetic tasks: a registry of generators for the embedded default and for tests.

A task is a class with `name`, `reward` (the reward it is graded with), and
`generate(n, seed, **task_args) -> list[dict]` returning rows with `prompt` (the user message, which
tells the model the answer format), `response` (the SFT target), `ground_truth` (what the reward
compares against) and `task`. It may also define `num_distinct(**task_args) -> int | None`, the number
of different problems it can produce, so data preparation can say why a split cannot be filled.
Generation draws only from `random.Random(seed)`, never from the global RNG.
"""
from __future__ import annotations

from typing import Any, Callable

from dare_core.registry import Registry

TASKS = Registry("task")


def register_task(name: str) -> Callable[[type], type]:
    return TASKS.register(name, set_name=True)


def get_task(name: str) -> Any:
    """An instance of the task registered as `name`."""
    return TASKS.lookup(name)()


# Imported for registration; after register_task exists so the module can use it.
from dare_core.data.tasks import arithmetic, countdown, sudoku  # noqa: E402,F401
