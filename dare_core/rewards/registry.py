"""Reward registry: pure, deterministic functions `(response_text, ground_truth, extra) -> RewardResult`.

`response_text` is the response decoded from ids cut at the first EOS, special tokens skipped.

A reward may also register a cheap validity check of a ground truth (`@ground_truth_check(name)`,
raising ValueError for one the reward could not grade), so that data preparation and the RL stage
reject such a row, naming it, before anything is trained or written. A reward without one accepts
every non-empty ground truth.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from dare_core.registry import Registry

RewardFn = Callable[[str, str, Optional[dict]], "RewardResult"]
GroundTruthCheck = Callable[[str], object]


@dataclass
class RewardResult:
    score: float
    acc: float
    pred: Optional[str]
    extra: dict = field(default_factory=dict)


REWARDS = Registry("reward")
GROUND_TRUTH_CHECKS = Registry("ground-truth check")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    return REWARDS.register(name)


def get_reward(name: str) -> RewardFn:
    return REWARDS.lookup(name)


def compute_reward(name: str, response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    return get_reward(name)(response_text, ground_truth, extra)


def ground_truth_check(name: str) -> Callable[[GroundTruthCheck], GroundTruthCheck]:
    """Register `fn(ground_truth)`, which raises ValueError when reward `name` cannot grade against it."""
    return GROUND_TRUTH_CHECKS.register(name)


def check_ground_truth(name: str, ground_truth: str) -> None:
    """Raise ValueError when reward `name` could not grade responses against `ground_truth`."""
    get_reward(name)
    check = GROUND_TRUTH_CHECKS.get(name)
    if check is not None:
        check(ground_truth)
