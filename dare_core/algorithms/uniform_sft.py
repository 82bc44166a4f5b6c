"""Uniform-noise SFT (DiffusionGemma; docs/diffusion.md#uniform-noise-sft): per example one time t,
its response corrupted toward uniformly random tokens, one canvas scored at all its positions given
the prompt and the clean canvases before it, plus the encoder's next-token loss, with
self-conditioning as the model was trained (`diffusion/uniform.py canvas_sft_loss`).

The SFT stage takes it for a family whose noise is uniform; the masked objective (`sft`) needs a
mask token, which such a family does not have."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dare_core.algorithms.base import Algorithm
from dare_core.algorithms.common import LossOutput
from dare_core.algorithms.registry import register_sft
from dare_core.batch import Batch
from dare_core.diffusion.uniform import canvas_batch, canvas_sft_loss, draw

@register_sft("uniform_sft")
class UniformNoiseSFT(Algorithm):
    @dataclass
    class Options:
        # the share of examples whose scored pass is conditioned on a first pass's logits
        self_conditioning: float = 0.5
        eps: float = 1e-4  # t ~ U[eps, 1 - eps]

    def __init__(self, options, mask_id=None):
        super().__init__(options)
        if not 0 <= options.self_conditioning <= 1 or not 0 < options.eps < 0.5:
            raise ValueError("uniform_sft: self_conditioning must be in [0, 1] and eps in (0, 0.5)")

    def global_denominator(self, response_masks: Sequence[torch.Tensor]) -> float:
        """Examples in the global batch: the loss is a mean over them."""
        return float(sum(m.shape[0] for m in response_masks))

    def loss(self, model, batch: Batch, generators: Sequence[torch.Generator], denom: float) -> LossOutput:
        prompts, responses = split_rows(batch, model.eos_token_id)
        canvases = canvas_batch(prompts, responses, model.block_size, model.eos_token_id, model.pad_token_id)
        canvases.ids, canvases.attention_mask = canvases.ids.to(batch.input_ids.device), canvases.attention_mask.to(batch.input_ids.device)
        draws = draw(canvases, model.config.vocab_size, generators, self.options.self_conditioning, self.options.eps)
        mean, metrics = canvas_sft_loss(model.net, canvases, draws)
        return LossOutput(mean * len(batch) / denom, {**metrics, "mask_prob": float(draws.t.mean())})


def split_rows(batch: Batch, eos_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's real prompt tokens and response tokens from the SFT layout (`sft_batch`), the
    response without the one EOS that layout appends (the canvas layout adds its own)."""
    prompts, responses = [], []
    p = batch.prompt_len
    for ids, mask, resp_mask in zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), batch.response_mask.tolist()):
        prompts.append([t for t, m in zip(ids[:p], mask[:p]) if m])
        response = [t for t, m in zip(ids[p:], resp_mask) if m]
        if response and response[-1] == eos_id:
            response = response[:-1]
        responses.append(response)
    return prompts, responses
