"""Rewards by name; importing this package registers every built-in reward (and the ground-truth
checks of those that have one)."""
from dare_core.rewards.registry import (REWARDS, RewardResult, check_ground_truth, compute_reward, get_reward,
                                        ground_truth_check, register_reward)
from dare_core.rewards import arithmetic, code, countdown, gsm8k, math, sudoku  # noqa: E402,F401  (registration)

__all__ = ["REWARDS", "RewardResult", "check_ground_truth", "compute_reward", "get_reward", "ground_truth_check",
           "register_reward"]
