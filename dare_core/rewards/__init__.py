"""Rewards by name (or a user's `module:function`); importing this package registers every built-in
reward (and the ground-truth checks of those that have one)."""
from dare_core.rewards import (arithmetic, choice, code, countdown, exact_match, gsm8k, math, numeric,  # noqa: F401
                               regex_match, sudoku)  # (registration)
from dare_core.rewards.base import RewardError, RewardResult
from dare_core.rewards.registry import (REWARDS, check_ground_truth, compute_reward, get_reward, ground_truth_check,
                                        is_reference, register_reward)

__all__ = ["REWARDS", "RewardError", "RewardResult", "check_ground_truth", "compute_reward", "get_reward",
           "ground_truth_check", "is_reference", "register_reward"]
