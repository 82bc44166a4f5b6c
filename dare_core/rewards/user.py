"""Rewards of the user's own, named by reference: `rl.reward: "mypkg.rewards:score"`.

The function is `score(completion: str, ground_truth: str, row: dict, **options) -> float | dict`:
- `row` is the data row being graded (for the `task` benchmark, the loaded benchmark row);
- options are `rl.reward_args` (or a row's `reward_args`), passed as keyword arguments;
- a float is both score and accuracy; a dict has `score` (required), optionally `acc` (default: the
  score) and `pred`, and any other keys go to the result's `extra`.
An optional attribute `score.validate = fn` is its ground-truth check: `fn(ground_truth)` raises
ValueError (or returns False) for a ground truth the reward cannot grade.

The module is imported once per process, from the installed packages or the current directory
(stages run from the repository root), where its signature and options are checked; the function and
its `validate` run in a host process of their own under a time limit (user_host.py,
$DARE_USER_CODE_TIMEOUT_S, default 60 s): a response whose grading outlives it scores 0 (reason
`timeout`), a `validate` that does (during prepare) stops the stage with one line naming the function. Every problem is a RewardError naming `module:function`;
one of scoring a single response (the function raised on it, returned something unusable or timed
out) is a UserRewardFault: the response scores 0 and `score_texts` stops the batch with it once the
faults pass the allowed share (a non-number at once).
"""
from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import sys
from typing import Any, Callable, Optional

from dare_core.errors import clip
from dare_core.rewards.base import (RewardError, RewardFn, RewardResult, UserRewardFault, UserRewardMalformed, accepted_args,
                                    check_options)
from dare_core.rewards.user_host import TIMEOUT_ENV, UserCodeFailed, UserCodeTimeout, run_user_code

# reference -> the loaded function: the import and its checks run once per process
_LOADED: dict[str, Callable] = {}


def _clip(value: Any) -> str:
    return clip(repr(value), 120)


def _split(reference: str) -> tuple[str, list[str]]:
    module, _, attr = reference.partition(":")
    parts = attr.split(".")
    if not module or not all(p.isidentifier() for p in module.split(".") + parts):
        raise RewardError(f"reward {reference!r}: expected module:function, e.g. 'mypkg.rewards:score'")
    return module, parts


def _import(reference: str, module_name: str):
    cwd = os.getcwd()
    # a console script's sys.path lacks the current directory, where the user's module sits
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise RewardError(f"reward {reference!r}: module {module_name!r} is not importable (no module named "
                              f"{exc.name!r} in {cwd} or the installed packages)") from None
        raise RewardError(f"reward {reference!r}: importing {module_name} failed: {exc}") from exc
    except Exception as exc:
        raise RewardError(f"reward {reference!r}: importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
    except SystemExit as exc:  # a module that exits at import would end the stage without a word
        raise RewardError(f"reward {reference!r}: importing {module_name} called sys.exit({exc.code!r})") from None


def _check_call(reference: str, fn: Callable, args: dict, partial: bool = False) -> None:
    """RewardError unless `fn(completion, ground_truth, row, **args)` binds (with `partial`, options
    it requires may be missing: they come with the reward's args)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to inspect (a builtin): calling it will tell
        return
    try:
        (signature.bind_partial if partial else signature.bind)("", "", {}, **args)
    except TypeError as exc:
        raise RewardError(f"reward {reference!r}: must take (completion, ground_truth, row, **options) "
                          f"({exc})") from None


def load_user_function(reference: str) -> Callable:
    """The function named by `module:function`, imported and checked once per process."""
    if reference in _LOADED:
        return _LOADED[reference]
    module_name, parts = _split(reference)
    obj = module = _import(reference, module_name)
    owner = module_name
    for part in parts:
        if not hasattr(obj, part):
            # the file tells a module of the user's from an installed one of the same name
            raise RewardError(f"reward {reference!r}: {owner} has no attribute {part!r} (module file: "
                              f"{getattr(module, '__file__', None)})")
        obj, owner = getattr(obj, part), f"{owner}.{part}"
    if not callable(obj):
        raise RewardError(f"reward {reference!r}: is not a function but {type(obj).__name__} {_clip(obj)}")
    _check_call(reference, obj, {}, partial=True)
    validate = getattr(obj, "validate", None)
    if validate is not None and not callable(validate):
        raise RewardError(f"reward {reference!r}: its 'validate' attribute is a {type(validate).__name__}, not a function")
    _LOADED[reference] = obj
    return obj


class RewardTimeout(UserRewardFault):
    """The user's reward did not return within the time limit on one response: it scores 0."""

    failure = "timeout"


def _on_row(row: dict) -> str:
    uid = row.get("uid") if isinstance(row, dict) else None
    return f" on row {uid}" if uid is not None else ""


def _finite(reference: str, key: str, value: Any, row: dict) -> float:
    if not isinstance(value, numbers.Real):
        raise UserRewardMalformed(f"reward {reference!r} returned {key} {_clip(value)} ({type(value).__name__}){_on_row(row)}; "
                          f"expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise UserRewardMalformed(f"reward {reference!r} returned a non-finite {key} {value}{_on_row(row)}")
    return value


def to_result(reference: str, value: Any, row: dict) -> RewardResult:
    """The RewardResult of what the user's function returned: a number, or a dict with `score`."""
    if isinstance(value, dict):
        if "score" not in value:
            raise UserRewardMalformed(f"reward {reference!r} returned a dict without 'score' (keys: {sorted(map(str, value))})"
                              f"{_on_row(row)}")
        score = _finite(reference, "score", value["score"], row)
        acc = _finite(reference, "acc", value["acc"], row) if "acc" in value else score
        pred = value.get("pred")
        extra = {k: v for k, v in value.items() if k not in ("score", "acc", "pred")}
        return RewardResult(score, acc, None if pred is None else str(pred), extra)
    if isinstance(value, numbers.Real):
        score = _finite(reference, "score", value, row)
        return RewardResult(score, score, None, {})
    raise UserRewardMalformed(f"reward {reference!r} returned {_clip(value)} ({type(value).__name__}){_on_row(row)}; "
                      f"expected a number or a dict with 'score'")


def _row_of(extra: Optional[dict]) -> dict:
    # scoring.py puts the graded row under extra["row"]; a direct call may pass the row as extra
    extra = extra or {}
    row = extra.get("row", extra)
    return row if isinstance(row, dict) else {}


def user_reward(reference: str, args: dict) -> RewardFn:
    """The user's function as a reward `(response_text, ground_truth, extra) -> RewardResult`."""
    fn = load_user_function(reference)
    check_options(reference, fn, args)
    _check_call(reference, fn, args)

    def reward(response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
        row = _row_of(extra)
        try:
            value = run_user_code(reference, "call", (response_text, ground_truth, row), args, _on_row(row).strip())
        except UserCodeTimeout as exc:
            raise RewardTimeout(str(exc)) from None
        except UserCodeFailed as exc:
            raise UserRewardFault(f"reward {reference!r} raised {exc.type_name}{_on_row(row)}: {exc.message}") from None
        return to_result(reference, value, row)

    return reward


def check_user_ground_truth(reference: str, ground_truth: str, args: dict) -> None:
    """The function's `validate(ground_truth)`, if it has one: ValueError for a ground truth it rejects."""
    validate = getattr(load_user_function(reference), "validate", None)
    if validate is None:
        return
    try:
        verdict = run_user_code(reference, "validate", (ground_truth,), accepted_args(validate, args),
                                f"on ground truth {_clip(ground_truth)}")
    except UserCodeTimeout as exc:  # the function, not the ground truth, is at fault
        raise RewardError(f"reward {reference!r}: its validate did not return within {exc.limit:g} s on ground truth "
                          f"{_clip(ground_truth)} (the limit: ${TIMEOUT_ENV}); it was stopped") from None
    except UserCodeFailed as exc:
        if exc.value_error:
            raise ValueError(f"reward {reference!r}: {exc.message}") from None
        raise RewardError(f"reward {reference!r}: its validate raised {exc.type_name}: {exc.message}") from None
    if verdict is False:
        raise ValueError(f"reward {reference!r}: validate rejected ground truth {_clip(ground_truth)}")
