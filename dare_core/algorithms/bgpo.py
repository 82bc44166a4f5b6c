"""BGPO, boundary-guided policy optimisation (docs/algorithms.md#bgpo): the stratified MC-ELBO (2.3,
law (b), N rows) with a per-row ratio that lower-bounds the objective,

  rho_j = 1 + D_j   if A > 0   (first-order lower bound of exp(mean D)),
  rho_j = exp(D_j)  if A <= 0  (Jensen),        D_j = (E_j - E_j_old) / Z,

L = (1/N) sum_j clip-loss(rho_j), mean over sequences. The loss is a sum over rows, so each row is
forwarded and backpropagated on its own and memory does not grow with N. 1 + D is computed
directly (the reference's exp(log(1 + D)) is NaN for D <= -1)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import LossOutput, ppo_clip_ratio, ratio_max, sequence_kl, weighted_mean_metrics
from dare_core.algorithms.registry import register_rl
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import elbo_rows, proxy_backward, separable_backward
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.mc_laws import count_rows
from dare_core.diffusion.seeding import sample_generators

ELBO_NORMS = ("auto", "none", "fixed", "valid")


def elbo_normaliser(norm: str, batch: Batch, gen_length: int, block: bool) -> torch.Tensor:
    """Z of 2.3 per sequence [B]: 1, the configured response length, or L_v ("auto": fixed for
    masked diffusion, valid for block diffusion, as the reference recipes)."""
    if norm == "auto":
        norm = "valid" if block else "fixed"
    if norm == "none":
        return torch.ones(len(batch))
    if norm == "fixed":
        return torch.full((len(batch),), float(gen_length))
    if norm == "valid":
        return batch.response_mask.float().sum(-1).clamp_min(1).cpu()
    raise ValueError(f"elbo_norm must be one of {ELBO_NORMS}, got '{norm}'")


@register_rl("bgpo")
class BGPO(RLAlgorithm):
    token_level = False

    @dataclass
    class Options:
        mc_num: int = 16
        elbo_norm: str = "auto"
        tail_policy: str = "mask"

    def check_sampler(self, sampler) -> None:
        self.gen_length = sampler.gen_length

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        gens = sample_generators((*seed_base, "bgpo"), batch.uids)
        cs = count_rows(batch.input_ids, batch.prompt_len, batch.response_mask, batch.attention_mask[:, batch.prompt_len:],
                        self.mask_id, self.options.mc_num, gens, tail_policy=self.options.tail_policy)
        cs.info["z"] = elbo_normaliser(self.options.elbo_norm, batch, self.gen_length, self.block_size is not None)
        return cs

    def score(self, model, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        """Per-row normalised ELBO samples E_j / Z: [B, N]."""
        return elbo_rows(model, corruption.rows, batch.input_ids, batch.attention_mask) / corruption.info["z"].to(batch.input_ids.device)[:, None]

    def denominator(self, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        return torch.tensor([float(len(batch))], dtype=torch.float64)

    def _row_loss(self, e: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        delta = e - old
        ratio = torch.where(adv[:, None] > 0, 1 + delta, torch.exp(delta.clamp(max=50)))
        per_row, clip = ppo_clip_ratio(ratio, adv[:, None], self.rl.clip_eps_low, self.rl.clip_eps_high, self.rl.dual_clip)
        return per_row, clip

    def update(self, model, batch: Batch, corruption: CorruptionSet, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        N, n_seq = len(corruption), max(float(denom[0]), 1.0)
        z = corruption.info["z"].to(batch.input_ids.device)[:, None]
        adv = batch.advantages.float().to(batch.input_ids.device)

        def rows_of(idx):
            return elbo_rows(model, [corruption.rows[i] for i in idx], batch.input_ids, batch.attention_mask) / z

        if self.rl.kl_beta <= 0 or ref is None:
            def chunk_loss(idx):  # separable: (1/N) sum_j, one chunk of rows at a time
                e = rows_of(idx)
                o = old[:, idx] if old is not None else e.detach()
                per_row, clip = self._row_loss(e, o.to(e), adv)
                w = torch.ones_like(per_row)
                metrics = {k: v * len(idx) / N for k, v in weighted_mean_metrics(clip, w).items()}
                return per_row.sum() / (N * n_seq), {**metrics, "ratio_max": ratio_max(clip, w)}

            loss, metrics = separable_backward(corruption, self.rows_per_forward, chunk_loss, backward)
            return LossOutput(torch.tensor(loss), metrics)

        def loss_of(e):  # with KL on the sequence score mean_j E_j/Z the loss is not separable
            o = old if old is not None else e.detach()
            per_row, clip = self._row_loss(e, o.to(e), adv)
            kl = sequence_kl(e.mean(1), ref.to(e).mean(1), self.rl)
            loss = per_row.mean(1).sum() / n_seq + self.rl.kl_beta * kl.sum() / n_seq
            metrics = weighted_mean_metrics(clip, torch.ones_like(per_row))
            metrics["ratio_max"] = ratio_max(clip, torch.ones_like(per_row))
            metrics["kl"] = float(kl.detach().mean())
            return loss, metrics

        loss, metrics = proxy_backward(corruption, self.rows_per_forward, rows_of, loss_of, backward)
        return LossOutput(loss, metrics)
