"""Reward registry: pure, deterministic functions `(response_text, ground_truth, extra) -> RewardResult`.

`response_text` is the response decoded from ids cut at the first EOS, special tokens skipped.
`extra` is context of the graded row (`task`; `row`, the data row itself, when scored through
`dare_core.rewards.scoring`).

A reward is named either by its registered name (`exact_match`) or by a reference to a user's
function, `module:function` (see `dare_core.rewards.user`). Options of a reward are its parameters
after the first three (keyword arguments with defaults, e.g. `exact_match(..., *, case=True)`);
`get_reward(name, args)` binds them, rejecting names the reward does not take.

A reward may also register a cheap validity check of a ground truth (`@ground_truth_check(name)`,
raising ValueError for one the reward could not grade), so that data preparation and the RL stage
reject such a row, naming it, before anything is trained or written. The check receives those of the
reward's options that it takes as parameters. A reward without one accepts every non-empty ground truth.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

from dare_core.registry import Registry
from dare_core.rewards.base import GroundTruthCheck, RewardFn, RewardResult, accepted_args, check_options
from dare_core.rewards.user import check_user_ground_truth, user_reward

REWARDS = Registry("reward")
GROUND_TRUTH_CHECKS = Registry("ground-truth check")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    if is_reference(name):  # ':' marks a user's module:function
        raise ValueError(f"reward name {name!r} must not contain ':'")
    return REWARDS.register(name)


def is_reference(name: str) -> bool:
    """True for a user's reward named `module:function` (registered names never contain ':')."""
    return ":" in name


def get_reward(name: str, args: Optional[Mapping[str, Any]] = None) -> RewardFn:
    """The reward `name` (registered, or `module:function`) with options `args` bound."""
    args = dict(args or {})
    if is_reference(name):
        return user_reward(name, args)
    fn = REWARDS.lookup(name, hint="or a function of your own as module:function")
    if not args:
        return fn
    check_options(name, fn, args)
    return functools.partial(fn, **args)


def compute_reward(name: str, response_text: str, ground_truth: str, extra: Optional[dict] = None,
                   args: Optional[Mapping[str, Any]] = None) -> RewardResult:
    return get_reward(name, args)(response_text, ground_truth, extra)


def ground_truth_check(name: str) -> Callable[[GroundTruthCheck], GroundTruthCheck]:
    """Register `fn(ground_truth, **options)`, which raises ValueError when reward `name` cannot grade
    against it; it receives those of the reward's options that it names as parameters."""
    return GROUND_TRUTH_CHECKS.register(name)


def check_ground_truth(name: str, ground_truth: str, args: Optional[Mapping[str, Any]] = None) -> None:
    """Raise ValueError when reward `name` with options `args` could not grade responses against
    `ground_truth` (RewardError, a ValueError too, when the reward itself is unusable)."""
    get_reward(name, args)  # unknown name, unknown option, or a reference that does not load
    if is_reference(name):
        check_user_ground_truth(name, ground_truth, dict(args or {}))
        return
    check = GROUND_TRUTH_CHECKS.get(name)
    if check is not None:
        check(ground_truth, **accepted_args(check, args or {}))
