"""Masked-diffusion SFT (docs/diffusion.md#sft-loss): completion-only Bernoulli masking at p ~ U(eps, 1),
loss = (1/B) sum_b [sum_{masked} CE / p_b] / n_b, a per-answer-token negative ELBO; with `edit_noise`
also LLaDA2.1's token-to-token stream (docs/diffusion.md#edit-noise).

The normaliser never depends on the sampled mask (dividing by the masked count would over-weight
small t and stop being an ELBO)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dare_core.algorithms.base import Algorithm
from dare_core.algorithms.common import LossOutput
from dare_core.algorithms.registry import register_sft
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import weighted_masked_nll
from dare_core.diffusion.masking import (EPS, count_mask, masked_corruption, response_corruption, sample_mask_prob,
                                        with_edit_noise)

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
        edit_noise: float = 0.0

    def __init__(self, options, mask_id: int, vocab_size: Optional[int] = None):
        super().__init__(options)
        if options.loss_norm not in LOSS_NORMS:
            raise ValueError(f"sft.loss_norm must be one of {LOSS_NORMS}, got '{options.loss_norm}'")
        if options.mask_law not in MASK_LAWS:
            raise ValueError(f"sft.mask_law must be one of {MASK_LAWS}, got '{options.mask_law}'")
        if not 0 <= options.edit_noise < 1 or (options.edit_noise > 0 and vocab_size is None):
            raise ValueError(f"sft.edit_noise must be in [0, 1), got {options.edit_noise}")
        self.mask_id, self.vocab_size = mask_id, vocab_size

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
        edited = 0
        if self.options.edit_noise > 0:
            corruption = with_edit_noise(corruption, batch.prompt_len, batch.response_mask, self.options.edit_noise,
                                         self.vocab_size, self.mask_id, generators)
            edited = int(corruption.scored.sum()) - int((corruption.noisy_ids == self.mask_id)[corruption.scored].sum())
        nll = weighted_masked_nll(model, corruption, batch.input_ids, batch.attention_mask)  # [B]
        if self.options.loss_norm == "answer_length":
            per_sample = nll / batch.response_mask.sum(-1).clamp_min(1).to(nll)
        else:
            per_sample = nll
        loss = per_sample.sum() / denom
        masked = corruption.scored.sum().item()
        metrics = {"masked_tokens": masked, "mask_prob": p.mean().item()}
        if self.options.edit_noise > 0:
            metrics["edited_tokens"] = edited
        return LossOutput(loss, metrics)
