"""Rewards by name; importing this package registers every built-in reward."""
from dare_core.rewards.registry import REWARDS, RewardResult, compute_reward, get_reward, register_reward
from dare_core.rewards import arithmetic, gsm8k  # noqa: E402,F401  (registration)

__all__ = ["REWARDS", "RewardResult", "compute_reward", "get_reward", "register_reward"]
