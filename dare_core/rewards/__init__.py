"""Rewards by name; importing this package registers every built-in reward."""
from dare_core.rewards.registry import REWARDS, RewardResult, compute_reward, get_reward, register_reward
from dare_core.rewards import arithmetic, code, countdown, gsm8k, math, sudoku  # noqa: E402,F401  (registration)

__all__ = ["REWARDS", "RewardResult", "compute_reward", "get_reward", "register_reward"]
