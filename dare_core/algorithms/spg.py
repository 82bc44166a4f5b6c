"""SPG, the sandwiched policy gradient (docs/algorithms.md#spg): no ratio, no old scores, no clipping.
Push up a lower bound (ELBO-like l+) of the likelihood of positive-advantage samples and push down
an upper bound (EUBO, or its mix with l+) for the others, over the block-wise law (2.5):

  L = sum_b ( -A_b * l_b * L_v,b ) / sum_b L_v,b,   l_b = l+ if A_b > 0 else l-.

KL and entropy are not part of the objective (rejected at configuration)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import LossOutput
from dare_core.algorithms.registry import register_rl
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import proxy_backward, rows_logprobs
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.mc_laws import blockwise_rows
from dare_core.diffusion.seeding import sample_generators

ESTIMATES = ("mix", "eubo", "elbo", "zero")


def spg_bounds(logp: torch.Tensor, scored: torch.Tensor, mask_fraction: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """From per-row token log-probs [B, R, L] on the rows' scored sets [B, R, L] and realised mask
    fractions t_j [B, R]: l+ = (1/R) sum_j mean_{i in S_j} log p, and the EUBO
    (1/beta) mean_{i: q_i > 0} log q_i with q_i = (1/R) sum_j p_i^beta 1[i in S_j] / t_j. [B] each."""
    R = logp.shape[1]
    sc = scored.float()
    per_row = (logp * sc).sum(-1) / sc.sum(-1).clamp_min(1)
    lower = per_row.mean(1)
    t = mask_fraction.clamp_min(1e-12)[..., None]
    q = (torch.exp(beta * logp) * sc / t).sum(1) / R
    hit = q > 0
    log_q = torch.log(torch.where(hit, q, torch.ones_like(q)))
    upper = (log_q * hit).sum(-1) / hit.sum(-1).clamp_min(1) / beta
    return lower, upper


@register_rl("spg")
class SPG(RLAlgorithm):
    families = frozenset({"masked"})
    token_level = False
    allows_kl = False

    @dataclass
    class Options:
        logp_estimation: str = "mix"  # mix | eubo | elbo | zero (the bound used for A <= 0)
        mix_weight: float = 0.5  # omega: l- = omega * EUBO + (1 - omega) * l+
        eubo_beta: float = 1.5
        p_mask_prompt: float = 0.15
        num_t: int = 2  # block-wise rows per sample per inner iteration (the SPG scripts: --num_t 2)
        block_size: Optional[int] = None  # null: the rollout's block_length

        def __post_init__(self):
            if self.logp_estimation not in ESTIMATES:
                raise ValueError(f"logp_estimation must be one of {ESTIMATES}")

    def check_sampler(self, sampler) -> None:
        self.mask_block = self.options.block_size or sampler.block_length

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        gens = sample_generators((*seed_base, "spg"), batch.uids)
        return blockwise_rows(batch.input_ids, batch.attention_mask, batch.prompt_len, batch.response_mask, self.mask_id,
                              self.mask_block, self.options.num_t, gens, self.options.p_mask_prompt)

    def score(self, model, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        return rows_logprobs(model, corruption.rows, batch.input_ids, batch.attention_mask).transpose(0, 1)

    def denominator(self, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        return torch.tensor([float(batch.response_mask.sum())], dtype=torch.float64)

    def update(self, model, batch: Batch, corruption: CorruptionSet, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        o = self.options
        P = batch.prompt_len
        scored = torch.stack([r.scored for r in corruption.rows], 1)[..., P:]  # [B, R, L]
        frac = corruption.info["mask_fraction"].to(scored.device)
        adv = batch.advantages.float().to(scored.device)
        lv = batch.response_mask.float().sum(-1)

        def stats(idx):  # [B, r, L] token log-probs of these rows
            return rows_logprobs(model, [corruption.rows[i] for i in idx], batch.input_ids, batch.attention_mask).transpose(0, 1)[..., P:]

        def loss_of(logp):
            lower, upper = spg_bounds(logp, scored, frac, o.eubo_beta)
            minus = {"eubo": upper, "elbo": lower, "mix": o.mix_weight * upper + (1 - o.mix_weight) * lower,
                     "zero": torch.zeros_like(lower)}[o.logp_estimation]
            bound = torch.where(adv > 0, lower, minus)
            loss = (-adv * bound * lv).sum() / max(float(denom[0]), 1.0)
            return loss, {"spg_lower": float(lower.detach().mean()), "spg_upper": float(upper.detach().mean())}

        loss, metrics = proxy_backward(corruption, self.rows_per_forward, stats, loss_of, backward)
        return LossOutput(loss, metrics)
