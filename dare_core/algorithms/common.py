"""Pieces every RL algorithm shares: group advantages, PPO clip (+ dual clip), KL estimators,
aggregation (ALGORITHMS.md 5.1)."""
from __future__ import annotations

import torch

from dare_core.registry import Registry

ADVANTAGES = Registry("adv_estimator")


@ADVANTAGES.register("grpo")
def _grpo(r: torch.Tensor) -> torch.Tensor:
    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, unbiased=True, keepdim=True) + 1e-6)


@ADVANTAGES.register("grpo_no_std")
def _grpo_no_std(r: torch.Tensor) -> torch.Tensor:
    return r - r.mean(-1, keepdim=True)


@ADVANTAGES.register("rloo")
def _rloo(r: torch.Tensor) -> torch.Tensor:
    g = r.shape[-1]
    return (r - r.mean(-1, keepdim=True)) * g / (g - 1)


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo") -> tuple[torch.Tensor, dict]:
    """rewards [N] laid out group by group (N = prompts * G) -> advantages [N] and metrics."""
    if group_size < 2:
        raise ValueError("group advantages need group_size >= 2")
    estimate = ADVANTAGES.lookup(estimator)
    r = rewards.float().view(-1, group_size)
    zero_std = r.std(-1, unbiased=True) == 0
    adv = estimate(r)
    adv = torch.where(zero_std[:, None], torch.zeros_like(adv), adv)
    return adv.reshape(-1), {"zero_std_ratio": zero_std.float().mean().item(), "reward_std": r.std(-1).mean().item()}


def ppo_clip(logratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Per-element clipped surrogate loss max(-A r, -A clip(r)), capped at -A c for A < 0 (dual clip)."""
    ratio = torch.exp(logratio)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(-adv * ratio, -adv * clipped)
    dual_hit = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip > 0:
        if dual_clip <= 1:
            raise ValueError("dual_clip must be > 1 (or 0 to disable)")
        capped = torch.minimum(loss, -adv * dual_clip)
        dual_hit = (adv < 0) & (capped < loss)
        loss = torch.where(adv < 0, capped, loss)
    metrics = {
        "clipfrac_hi": ((ratio > 1 + eps_high) & (adv > 0)).float(),
        "clipfrac_lo": ((ratio < 1 - eps_low) & (adv < 0)).float(),
        "dual_clipfrac": dual_hit.float(),
        "ratio": ratio.detach(),
    }
    return loss, metrics


def kl_estimate(s: torch.Tensor, s_ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """KL(pi || ref) estimators on delta = s - s_ref; never looks at the advantage."""
    delta = s - s_ref
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta**2
    if estimator == "k3":
        return (torch.exp(-delta) + delta - 1).clamp(max=10.0)
    raise ValueError(f"unknown kl_estimator '{estimator}'")


def masked_sum_over(x: torch.Tensor, mask: torch.Tensor, denom: float) -> torch.Tensor:
    """Token-mean with a global denominator: sum(mask * x) / denom, so micro-batch splits do not
    change the gradient (denom counts the whole mini-batch, computed before the backward pass)."""
    return (x * mask).sum() / max(denom, 1.0)
