"""Grading a batch of responses: each row's reward (`scoring.score_texts`), the rewards as a tensor
and the metrics every rollout reports about them. RL rollouts (the default and d-TreeRPO's tree),
per-step rewards (MDPO) and in-loop validation grade through `grade`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from dare_core.rewards.base import RewardResult
from dare_core.rewards.scoring import failure_metrics, score_texts


@dataclass
class Grades:
    results: list[RewardResult]  # in input order
    rewards: torch.Tensor  # [N] float32, the results' scores

    @property
    def metrics(self) -> dict[str, float]:
        """`reward` (mean score), `accuracy`, `extraction_failed` (the fraction the reward could not
        parse) and `failure_metrics` (responses whose grading failed: a reward's error, a sandbox
        timeout, ...)."""
        n = len(self.results)
        return {
            "reward": self.rewards.mean().item(),
            "accuracy": sum(r.acc for r in self.results) / n,
            "extraction_failed": sum(1 for r in self.results if r.extra.get("extraction_failed")) / n,
            **failure_metrics(self.results),
        }


ERRORS_SETTING = "rl.reward_errors_allowed"


def grade(rows: Sequence[dict], texts: Sequence[str], reward: str = "auto",
          reward_args: Optional[Mapping[str, Any]] = None, errors_allowed: float = 0.0) -> Grades:
    """Grade `texts[i]` against `rows[i]` with the row's reward (`scoring.reward_for`); a user's
    reward failing on more than `errors_allowed` of them raises RewardFailed (`scoring.score_texts`)."""
    results = score_texts(rows, texts, reward, reward_args, errors_allowed=errors_allowed, setting=ERRORS_SETTING)
    return Grades(results, torch.tensor([r.score for r in results], dtype=torch.float32))
