"""Reward registry: pure, deterministic functions `(response_text, ground_truth, extra) -> RewardResult`.

`response_text` is the response decoded from ids cut at the first EOS, special tokens skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from dare_core.registry import Registry

RewardFn = Callable[[str, str, Optional[dict]], "RewardResult"]


@dataclass
class RewardResult:
    score: float
    acc: float
    pred: Optional[str]
    extra: dict = field(default_factory=dict)


REWARDS = Registry("reward")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    return REWARDS.register(name)


def get_reward(name: str) -> RewardFn:
    return REWARDS.lookup(name)


def compute_reward(name: str, response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    return get_reward(name)(response_text, ground_truth, extra)
