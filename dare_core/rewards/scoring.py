"""Scoring responses with the reward of each row: RL rewards, in-loop validation and the `task`
benchmark all grade through here, so "correct" means the same thing everywhere.

Which reward grades a row, first match wins:
1. the configured one (rl.reward, with rl.reward_args) unless it is "auto";
2. the row's own `reward` column (a name or `module:function`), with its `reward_args` column;
3. a reward named like the row's task (with the row's `reward_args`, if it has them).
Data preparation fills the `reward` column of every row it writes (a synthetic task's from its
registration, `dare_core.data.sources`), so prepared rows always match at 1 or 2.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

from dare_core.rewards.base import RewardResult
from dare_core.rewards.registry import REWARDS, compute_reward


def parse_reward_args(text: Optional[str]) -> dict:
    """A `reward_args` column (JSON object text) as a dict; {} for none."""
    if not text:
        return {}
    try:
        args = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"column 'reward_args' is not JSON ({exc}): {text!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"column 'reward_args' must be a JSON object, got {text!r}")
    return args


def row_reward_args(row: dict) -> dict:
    """The options of the row's own reward, from its `reward_args` column; {} when it has none."""
    try:
        return parse_reward_args(row.get("reward_args"))
    except ValueError as exc:
        raise ValueError(f"row {row.get('uid')}: {exc}") from None


def reward_for(row: dict, configured: str = "auto", configured_args: Optional[Mapping[str, Any]] = None) -> tuple[str, dict]:
    """(reward name or `module:function`, its options) that grade `row` (see the module docstring)."""
    if configured != "auto":
        return configured, dict(configured_args or {})
    if row.get("reward"):
        return row["reward"], row_reward_args(row)
    task = row.get("task", "")
    if task in REWARDS:
        return task, row_reward_args(row)
    raise ValueError(f"row {row.get('uid')}: no reward for task '{task}' (set rl.reward explicitly)")


def reward_name_for(row: dict, configured: str = "auto") -> str:
    """The reward of a row: the configured one, else the row's `reward` column, else its task's."""
    return reward_for(row, configured)[0]


def score_row(row: dict, text: str, reward: str = "auto", reward_args: Optional[Mapping[str, Any]] = None) -> RewardResult:
    """Grade one response against `row["ground_truth"]` with the row's reward."""
    name, args = reward_for(row, reward, reward_args)
    return compute_reward(name, text, row["ground_truth"], {"task": row.get("task"), "row": row}, args)


def score_texts(rows: Sequence[dict], texts: Sequence[str], reward: str = "auto",
                reward_args: Optional[Mapping[str, Any]] = None) -> list[RewardResult]:
    return [score_row(r, t, reward, reward_args) for r, t in zip(rows, texts)]
