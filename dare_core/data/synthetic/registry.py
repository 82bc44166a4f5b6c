"""The registry of synthetic tasks (`data.task: <name>`); see the package docstring."""
from __future__ import annotations

from typing import Any, Callable

from dare_core.registry import Registry

TASKS = Registry("task")


def register_task(name: str) -> Callable[[type], type]:
    return TASKS.register(name, set_name=True)


def get_task(name: str) -> Any:
    """An instance of the task registered as `name`."""
    return TASKS.lookup(name)()

