"""Pieces every RL algorithm shares: group advantages, PPO clip (+ dual clip), KL estimators,
aggregation (docs/algorithms.md#rl-shared)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from dare_core.diffusion.likelihood import chunks, elbo_rows, proxy_backward, rows_logprobs, separable_backward
from dare_core.metric_keys import is_max_metric
from dare_core.registry import Registry


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict = field(default_factory=dict)


ADVANTAGES = Registry("adv_estimator")
# the largest sequence log-ratio exp ever sees (e^50 ~ 5e21 is finite in float32)
MAX_LOG_RATIO = 50.0


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


def ppo_clip_ratio(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Per-element clipped surrogate max(-A r, -A clip(r)), capped at -A c for A < 0 (dual clip)."""
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


def ppo_clip(logratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate of r = exp(logratio)."""
    return ppo_clip_ratio(torch.exp(logratio), adv, eps_low, eps_high, dual_clip)


def ppo_clip_log_space(logratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The same surrogate for sequence-level log-ratios that overflow exp (5.1.2): clip in log
    space, -A exp(min(D, log(1+eps_hi))) for A >= 0, -A exp(max(D, log(1-eps_lo))) for A < 0
    (capped at log c under the dual clip), so exp never sees a large argument."""
    hi = math.log1p(eps_high)
    lo = math.log(1 - eps_low) if eps_low < 1 else -math.inf
    pos = torch.clamp(logratio, max=hi)
    # without the dual clip the A < 0 side is unbounded: cap its exponent so exp stays finite
    neg = torch.clamp(logratio, min=lo, max=MAX_LOG_RATIO)
    if dual_clip > 0:
        if dual_clip <= 1:
            raise ValueError("dual_clip must be > 1 (or 0 to disable)")
        neg = torch.clamp(neg, max=math.log(dual_clip))
    # pick the exponent before exp: exp of the unselected branch could be inf, and where's zero
    # gradient times inf is NaN
    loss = -adv * torch.exp(torch.where(adv >= 0, pos, neg))
    metrics = {
        "clipfrac_hi": ((logratio > hi) & (adv > 0)).float(),
        "clipfrac_lo": ((logratio < lo) & (adv < 0)).float(),
        "dual_clipfrac": ((adv < 0) & (logratio > math.log(dual_clip))).float() if dual_clip > 0 else torch.zeros_like(loss),
        "ratio": torch.exp(logratio.detach().clamp(max=MAX_LOG_RATIO)),
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


def weighted_mean_metrics(metrics: dict, weight: torch.Tensor) -> dict:
    """Metric tensors averaged with `weight` (a mask or aggregation weights) into floats."""
    total = float(weight.sum())
    return {k: float((v.float() * weight).sum()) / max(total, 1e-12) for k, v in metrics.items()}


def ratio_max(clip: dict, mask: torch.Tensor) -> float:
    """The largest importance ratio among the scored entries (1.0 where none is): a mean hides the
    one sequence whose ratio spikes. Combined over micro-batches and ranks by max (`*_max` keys)."""
    scored = clip["ratio"][mask.bool()]
    return float(scored.max()) if scored.numel() else 1.0


def wants_entropy(rl) -> bool:
    """Whether the update needs the policy's entropy at the scored tokens (rl.entropy_coeff > 0):
    only then do the scores compute the full-vocabulary entropy (5.1.6)."""
    return getattr(rl, "entropy_coeff", 0.0) > 0


def entropy_bonus(entropy: torch.Tensor, weight: torch.Tensor, denom: float, rl) -> tuple[torch.Tensor, float]:
    """The entropy bonus term -entropy_coeff * sum(weight * H) / denom (the policy term's
    aggregation, global denominator) and the metric: H's plain mean over the scored tokens."""
    term = -rl.entropy_coeff * (entropy * weight).sum() / max(denom, 1e-12)
    return term, weighted_mean_metrics({"h": entropy.detach()}, (weight != 0).float())["h"]


def token_policy_loss(s: torch.Tensor, old: Optional[torch.Tensor], ref: Optional[torch.Tensor], adv: torch.Tensor,
                      weight: torch.Tensor, denom: float, rl, entropy: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """The token-level PPO objective shared by d1, coupled-GRPO, CJ-GRPO, MDPO, d-TreeRPO and
    JustGRPO: sum(weight * clip-loss(s - s_old, A)) / denom, plus kl_beta times the same
    aggregation of the KL estimator (which never looks at A). `weight` [B, S] is 0 off the scored
    positions and carries the algorithm's aggregation (1 for token-mean). `entropy` [B, S] (given
    when rl.entropy_coeff > 0): the policy's entropy at the scored tokens, whose same aggregation,
    times entropy_coeff, is subtracted (a bonus: maximised); logged as `entropy`."""
    if old is None:  # one update per rollout batch: pi_old is the current policy
        old = s.detach()
    per_token, clip = ppo_clip(s - old, adv, rl.clip_eps_low, rl.clip_eps_high, rl.dual_clip)
    loss = (per_token * weight).sum() / max(denom, 1e-12)
    mask = (weight != 0).float()
    metrics = weighted_mean_metrics(clip, mask)
    metrics["ratio_max"] = ratio_max(clip, mask)
    metrics["approx_kl"] = weighted_mean_metrics({"d": (old - s).detach()}, mask)["d"]
    if rl.kl_beta > 0 and ref is not None:
        kl = kl_estimate(s, ref, rl.kl_estimator)
        loss = loss + rl.kl_beta * (kl * weight).sum() / max(denom, 1e-12)
        metrics["kl"] = weighted_mean_metrics({"kl": kl.detach()}, mask)["kl"]
    if entropy is not None and wants_entropy(rl):
        bonus, metrics["entropy"] = entropy_bonus(entropy, weight, denom, rl)
        loss = loss + bonus
    return loss, metrics


def sequence_kl(score: torch.Tensor, ref: Optional[torch.Tensor], rl) -> Optional[torch.Tensor]:
    """Per-sequence KL estimator on the sequence-score difference (5.1.4), or None when off."""
    if rl.kl_beta <= 0 or ref is None:
        return None
    return kl_estimate(score, ref, rl.kl_estimator)


def sequence_policy_loss(score: torch.Tensor, old: Optional[torch.Tensor], ref: Optional[torch.Tensor], adv: torch.Tensor,
                         denom: float, rl, ratio_scale: float = 1.0, kl_scale: float = 1.0) -> tuple[torch.Tensor, dict]:
    """One clipped ratio per sequence (EBPO, ESPO): log-ratio (S - S_old) * ratio_scale clipped in
    log space against the sequence advantage, summed over sequences / denom (seq-mean), plus
    kl_beta * kl_scale * KL estimator of (S - S_ref) on the unscaled scores."""
    if old is None:
        old = score.detach()
    per_seq, clip = ppo_clip_log_space((score - old) * ratio_scale, adv, rl.clip_eps_low, rl.clip_eps_high, rl.dual_clip)
    loss = per_seq.sum() / max(denom, 1e-12)
    metrics = weighted_mean_metrics(clip, torch.ones_like(per_seq))
    metrics["ratio_max"] = ratio_max(clip, torch.ones_like(per_seq))
    metrics["approx_kl"] = float(((old - score) * ratio_scale).detach().mean())
    kl = sequence_kl(score, ref, rl)
    if kl is not None:
        loss = loss + rl.kl_beta * kl_scale * kl.sum() / max(denom, 1e-12)
        metrics["kl"] = float(kl.detach().mean())
    return loss, metrics


class SequenceELBOMixin:
    """score / denominator / update of the sequence-ratio ELBO algorithms (EBPO, ESPO): the rows
    of a `CorruptionSet` are raw ELBO samples, S = their mean, one clipped ratio per sequence,
    gradients by proxy-gradient replay. Subclasses set `ratio_scale` (1/L_max for ESPO)."""

    token_level = False
    ratio_scale: float = 1.0

    def score(self, model, batch, corruption) -> torch.Tensor:
        """Raw per-row ELBO samples [B, R]."""
        return elbo_rows(model, corruption.rows, batch.input_ids, batch.attention_mask)

    def denominator(self, batch, corruption) -> torch.Tensor:
        return torch.tensor([float(len(batch))], dtype=torch.float64)

    def update(self, model, batch, corruption, old, ref, denom, backward):
        adv = batch.advantages.float().to(batch.input_ids.device)

        def rows_of(idx):
            return elbo_rows(model, [corruption.rows[i] for i in idx], batch.input_ids, batch.attention_mask)

        def loss_of(e):
            mean = lambda t: None if t is None else t.to(e).mean(1)  # noqa: E731
            return sequence_policy_loss(e.mean(1), mean(old), mean(ref), adv, float(denom[0]), self.rl,
                                        ratio_scale=self.ratio_scale, kl_scale=self.ratio_scale)

        loss, metrics = proxy_backward(corruption, self.rows_per_forward, rows_of, loss_of, backward)
        return LossOutput(loss, metrics)


def replay_temperature(sampler, override: Optional[float]) -> float:
    """The temperature trajectory scores use: the rollout's, so the ratio compares the
    distributions that actually sampled (a greedy rollout has none: score untempered)."""
    if override is not None:
        return override
    return sampler.temperature if sampler.temperature > 0 else 1.0


def replayed_token_update(algo, model, batch, corruption, old, ref, backward, weight_of, combine=None):
    """The update of the trajectory algorithms whose rows score disjoint tokens (CJ-GRPO steps,
    JustGRPO positions): each chunk of rows is scored at the replay temperature (MASK excluded, as
    the sampler excludes it), its token PPO loss weighted by `weight_of(idx, rows) -> [B, S]` (which
    carries the global normalisers; 0 off the chunk's positions) and backpropagated on its own.
    `combine(idx, values [r, B, S]) -> [B, X]` lays the rows' values out as `old`, `ref` and the
    weights are (default: their sum, each token's own row's value); an edited trajectory scores a
    position at each of its writes, one entry per write (`replay.by_write`)."""
    adv = batch.advantages[:, None].float()
    with_entropy = wants_entropy(algo.rl)
    combine = combine or (lambda idx, values: values.sum(0))

    def chunk_loss(idx):
        rows = [corruption.rows[i] for i in idx]
        scores = rows_logprobs(model, rows, batch.input_ids, batch.attention_mask, algo.temperature, (algo.mask_id,), with_entropy)
        s, h = (combine(idx, scores[0]), combine(idx, scores[1])) if with_entropy else (combine(idx, scores), None)
        weight = weight_of(idx, rows).to(s)
        here = weight != 0
        pick = lambda t: None if t is None else t * here  # noqa: E731  (this chunk's positions only)
        return token_policy_loss(s, pick(old), pick(ref), adv.to(s), weight, 1.0, algo.rl, h)

    loss, metrics = separable_backward(corruption, algo.rows_per_forward, chunk_loss, backward)
    n = len(chunks(len(corruption), algo.rows_per_forward))
    return LossOutput(torch.tensor(loss), {k: v if is_max_metric(k) else v / max(n, 1) for k, v in metrics.items()})
