"""The registry of synthetic tasks (`data.task: <name>`); see the package docstring."""
from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Callable

from dare_core.registry import Registry

TASKS = Registry("task")


def register_task(name: str) -> Callable[[type], type]:
    return TASKS.register(name, set_name=True)


def get_task(name: str) -> Any:
    """An instance of the task registered as `name`."""
    return TASKS.lookup(name)()



def check_task_args(task: Any, args: dict) -> None:
    """ValueError naming `data.task_args.<key>` unless every key is an option of the task's
    `generate` and each value has its default's type (a typo would otherwise end prepare with a
    TypeError's traceback, or a string where a number belongs in a comparison deep in the task)."""
    params = {name: p for name, p in list(inspect.signature(task.generate).parameters.items())[2:]
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key, value in args.items():
        if key not in params:
            close = difflib.get_close_matches(str(key), list(params), n=1)
            hint = f"; did you mean data.task_args.{close[0]}?" if close else ""
            raise ValueError(f"unknown setting data.task_args.{key}{hint} (task '{task.name}' takes "
                             f"{', '.join(sorted(params))})")
        default = params[key].default
        if default is inspect.Parameter.empty or default is None:
            continue
        kind = type(default)
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            what = {float: "a finite number", int: "a whole number", bool: "true or false", str: "text"}.get(
                kind, f"of type {kind.__name__}")
            raise ValueError(f"data.task_args.{key} must be {what} (task '{task.name}'), got {value!r}")
