"""Checks of reward options (`rl.reward_args`), shared by the built-in rewards: a wrong value is a
RewardError naming the reward, the option and what it accepts (a settings problem, not a data one),
raised by the ground-truth check at stage start rather than by the first graded response."""
from __future__ import annotations

import numbers
from typing import Any, Iterable

from dare_core.rewards.base import RewardError


def flag(reward: str, option: str, value: Any) -> bool:
    # YAML gives real booleans; a string such as "false" would silently read as true
    if not isinstance(value, bool):
        raise RewardError(f"{reward} reward: option {option} must be true or false, got {value!r}")
    return value


def one_of(reward: str, option: str, value: Any, allowed: Iterable[str]) -> str:
    allowed = list(allowed)
    if value not in allowed:
        raise RewardError(f"{reward} reward: option {option} must be one of {allowed}, got {value!r}")
    return value


def non_negative(reward: str, option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise RewardError(f"{reward} reward: option {option} must be a number >= 0, got {value!r}")
    return float(value)
