"""Reward registry: pure, deterministic functions `(response_text, ground_truth, extra) -> RewardResult`.

`response_text` is the response decoded from ids cut at the first EOS, special tokens skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

RewardFn = Callable[[str, str, Optional[dict]], "RewardResult"]


@dataclass
class RewardResult:
    score: float
    acc: float
    pred: Optional[str]
    extra: dict = field(default_factory=dict)


REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward '{name}' is registered twice")
        REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward '{name}'; known rewards: {sorted(REWARDS)}")
    return REWARDS[name]


def compute_reward(name: str, response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    return get_reward(name)(response_text, ground_truth, extra)
