"""Scoring responses with the reward of each row's task: RL rewards, in-loop validation and the
`task` benchmark all grade through here, so "correct" means the same thing everywhere."""
from __future__ import annotations

from typing import Sequence

from dare_core.rewards import REWARDS, compute_reward


def reward_name_for(row: dict, configured: str = "auto") -> str:
    """The reward of a row: the configured one, else its task's, else a reward named like the task."""
    if configured != "auto":
        return configured
    from dare_core.data.tasks import TASKS

    task = row.get("task", "")
    if task in TASKS:
        return TASKS[task].reward
    if task in REWARDS:
        return task
    raise ValueError(f"row {row.get('uid')}: no reward for task '{task}' (set rl.reward explicitly)")


def score_texts(rows: Sequence[dict], texts: Sequence[str], reward: str = "auto") -> list:
    return [compute_reward(reward_name_for(r, reward), t, r["ground_truth"], {"task": r.get("task")}) for r, t in zip(rows, texts)]
