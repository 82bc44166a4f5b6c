"""d1 / diffu-GRPO (docs/algorithms.md#d1): the one-step mean-field estimator with a fresh prompt mask
per inner iteration, token-level PPO clip over the valid region V, token-mean, optional KL."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import LossOutput, token_policy_loss, wants_entropy
from dare_core.algorithms.registry import register_rl
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import token_logprobs
from dare_core.diffusion.masking import Corruption, full_response_corruption
from dare_core.diffusion.seeding import sample_generators


@register_rl("d1")
class D1(RLAlgorithm):
    """Masked families as in the paper; on block diffusion the same estimator is the per-block
    mean field (every noisy block fully masked, given the clean earlier blocks)."""

    scores_within_stop = True  # V only, each position MASK whatever follows it
    # under uniform noise the response is all random tokens (t = 1 of that process) instead of all MASK
    families = frozenset({"masked", "block", "uniform"})

    @dataclass
    class Options:
        p_mask_prompt: float = 0.15

    def corrupt(self, batch: Batch, seed_base: tuple) -> Corruption:
        gens = sample_generators((*seed_base, "d1_prompt_mask"), batch.uids)
        # every response position MASK, V scored (the batch's V: up to the engine's stop token)
        return full_response_corruption(batch.input_ids, batch.attention_mask, batch.prompt_len, batch.response_mask,
                                        self.mask_id, self.options.p_mask_prompt, gens, self.vocab_size)

    def score(self, model, batch: Batch, corruption: Corruption) -> torch.Tensor:
        return token_logprobs(model, corruption, batch.input_ids, batch.attention_mask)

    def update(self, model, batch: Batch, corruption: Corruption, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        entropy = None
        if wants_entropy(self.rl):  # the entropy at the scored tokens, from the same forward
            s, entropy = token_logprobs(model, corruption, batch.input_ids, batch.attention_mask, entropy=True)
        else:
            s = self.score(model, batch, corruption)
        loss, metrics = token_policy_loss(s, old, ref, batch.advantages[:, None].to(s), corruption.scored.float(), float(denom[0]),
                                          self.rl, entropy)
        backward(loss)
        return LossOutput(loss.detach(), metrics)
