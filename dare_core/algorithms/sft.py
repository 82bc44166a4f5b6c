"""Masked-diffusion SFT (docs/diffusion.md#sft-loss): completion-only Bernoulli masking at p ~ U(eps, 1),
loss = (1/B) sum_b [sum_{masked} CE / p_b] / n_b, a per-answer-token negative ELBO.

The normaliser never depends on the sampled mask (dividing by the masked count would over-weight
small t and stop being an ELBO)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dare_core.algorithms.base import Algorithm
from dare_core.algorithms.common import LossOutput
from dare_core.algorithms.registry import register_sft
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import weighted_masked_nll
from dare_core.diffusion.masking import EPS, count_mask, masked_corruption, response_corruption, sample_mask_prob

LOSS_NORMS = ("answer_length", "token", "batch")
MASK_LAWS = ("bernoulli", "count")


@register_sft("sft")
class MaskedDiffusionSFT(Algorithm):
    @dataclass
    class Options:
        loss_norm: str = "answer_length"
        # bernoulli: t ~ U(eps, 1), each position masked w.p. t (LLaDA's law);
        # count: l ~ U{1..n} positions masked, weight n/l (same ELBO, bounded weights)
        mask_law: str = "bernoulli"
        eps: float = EPS

    def __init__(self, options, mask_id: int):
        super().__init__(options)
        if options.loss_norm not in LOSS_NORMS:
            raise ValueError(f"sft.loss_norm must be one of {LOSS_NORMS}, got '{options.loss_norm}'")
        if options.mask_law not in MASK_LAWS:
            raise ValueError(f"sft.mask_law must be one of {MASK_LAWS}, got '{options.mask_law}'")
        self.mask_id = mask_id

    def global_denominator(self, response_masks: Sequence[torch.Tensor]) -> float:
        """The normaliser over the whole global batch (all micro-batches, all ranks)."""
        if self.options.loss_norm == "token":
            return float(sum(m.sum().item() for m in response_masks))
        return float(sum(m.shape[0] for m in response_masks))

    def loss(self, model, batch: Batch, generators: Sequence[torch.Generator], denom: float) -> LossOutput:
        if self.options.mask_law == "count":
            masked, p = count_mask(batch.response_mask, generators)
            corruption = masked_corruption(batch.input_ids, batch.prompt_len, masked, self.mask_id, p)
        else:
            p = sample_mask_prob(generators, self.options.eps)
            corruption = response_corruption(batch.input_ids, batch.prompt_len, batch.response_mask, self.mask_id, p, generators,
                                             at_least_one=model.block_size is not None)
        nll = weighted_masked_nll(model, corruption, batch.input_ids, batch.attention_mask)  # [B]
        if self.options.loss_norm == "answer_length":
            per_sample = nll / batch.response_mask.sum(-1).clamp_min(1).to(nll)
        else:
            per_sample = nll
        loss = per_sample.sum() / denom
        masked = corruption.scored.sum().item()
        return LossOutput(loss, {"masked_tokens": masked, "mask_prob": p.mean().item()})
