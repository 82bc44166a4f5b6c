"""d1 / diffu-GRPO (ALGORITHMS.md 5.2): the one-step mean-field estimator with a fresh prompt mask
per inner iteration, token-level PPO clip over the valid region V, token-mean, optional k3 KL."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import Batch, LossOutput, RLAlgorithm
from dare_core.algorithms.common import kl_estimate, masked_sum_over, ppo_clip
from dare_core.algorithms.registry import register
from dare_core.diffusion.likelihood import mean_field_corruption, token_logprobs
from dare_core.diffusion.masking import Corruption
from dare_core.diffusion.seeding import sample_generators


@register("d1")
class D1(RLAlgorithm):
    @dataclass
    class Options:
        p_mask_prompt: float = 0.15

    def corrupt(self, batch: Batch, seed_base: tuple) -> Corruption:
        gens = sample_generators((*seed_base, "d1_prompt_mask"), batch.uids)
        return mean_field_corruption(
            batch.input_ids, batch.attention_mask, batch.prompt_len, self.eos_id, self.mask_id,
            self.options.p_mask_prompt, gens,
        )

    def score(self, model, batch: Batch, corruption: Corruption) -> torch.Tensor:
        return token_logprobs(model, corruption, batch.input_ids, batch.attention_mask)

    def loss(self, model, batch: Batch, corruption: Corruption, old: Optional[torch.Tensor], ref: Optional[torch.Tensor], denom: float) -> LossOutput:
        s = self.score(model, batch, corruption)
        if old is None:  # one update per rollout batch: pi_old is the current policy
            old = s.detach()
        mask = corruption.scored.float()
        adv = batch.advantages[:, None].to(s)
        per_token, clip = ppo_clip(s - old, adv, self.rl.clip_eps_low, self.rl.clip_eps_high, self.rl.dual_clip)
        loss = masked_sum_over(per_token, mask, denom)
        metrics = {k: masked_sum_over(v, mask, mask.sum().item()).item() for k, v in clip.items()}
        metrics["approx_kl"] = masked_sum_over((old - s).detach(), mask, mask.sum().item()).item()
        if self.rl.kl_beta > 0 and ref is not None:
            kl = kl_estimate(s, ref, self.rl.kl_estimator)
            loss = loss + self.rl.kl_beta * masked_sum_over(kl, mask, denom)
            metrics["kl"] = masked_sum_over(kl.detach(), mask, mask.sum().item()).item()
        return LossOutput(loss, metrics)
