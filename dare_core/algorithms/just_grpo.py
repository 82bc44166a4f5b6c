"""JustGRPO (ALGORITHMS.md 5.11): roll out left to right (block 1, one token per step, no cache) so
that the exact AR likelihood (2.7) is the probability the sampler drew each token with; token-level
PPO (dual) clip, token-mean over V. Scored at the rollout temperature."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import Batch, LossOutput, RLAlgorithm
from dare_core.algorithms.common import token_policy_loss
from dare_core.algorithms.registry import register
from dare_core.diffusion.likelihood import rows_logprobs, separable_backward
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.replay import ar_rows


def replay_temperature(sampler, override: Optional[float]) -> float:
    """The temperature trajectory scores use: the rollout's, so the ratio compares the
    distributions that actually sampled (a greedy rollout has none: score untempered)."""
    if override is not None:
        return override
    return sampler.temperature if sampler.temperature > 0 else 1.0


@register("just_grpo")
class JustGRPO(RLAlgorithm):
    families = frozenset({"masked"})

    @dataclass
    class Options:
        pass

    def check_sampler(self, sampler) -> None:
        problems = []
        if sampler.block_length != 1:
            problems.append("block_length: 1")
        if sampler.steps != sampler.gen_length:
            problems.append(f"steps: {sampler.gen_length} (= gen_length)")
        if sampler.cache != "none":
            problems.append("cache: none")
        if sampler.unmasking != "topk":
            problems.append("unmasking: topk")
        if sampler.temperature <= 0:
            problems.append("temperature > 0 (the learner scores at the rollout temperature)")
        # the learner's s_t is log softmax(f / T) without MASK: anything else that reshapes the
        # sampling distribution would make it differ from the probability the token was drawn with
        if sampler.top_k or sampler.top_p < 1 or sampler.cfg_scale > 0 or sampler.logits_eos_inf:
            problems.append("top_k: 0, top_p: 1.0, cfg_scale: 0, logits_eos_inf: false")
        if problems:
            raise ValueError("rl.algorithm just_grpo needs a left-to-right rollout: set rl.sampler " + ", ".join(problems))
        self.temperature = sampler.temperature

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        return ar_rows(batch.input_ids, batch.prompt_len, batch.response_mask, self.mask_id)

    def score(self, model, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        return rows_logprobs(model, corruption.rows, batch.input_ids, batch.attention_mask, self.temperature, (self.mask_id,)).sum(0)

    def update(self, model, batch: Batch, corruption: CorruptionSet, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        adv = batch.advantages[:, None].float()

        def chunk_loss(idx):
            rows = [corruption.rows[i] for i in idx]
            s = rows_logprobs(model, rows, batch.input_ids, batch.attention_mask, self.temperature, (self.mask_id,)).sum(0)
            mask = torch.stack([r.scored for r in rows]).any(0).float()
            pick = lambda t: None if t is None else t * mask  # noqa: E731  (this chunk's positions only)
            return token_policy_loss(s, pick(old), pick(ref), adv.to(s), mask, float(denom[0]), self.rl)

        loss, metrics = separable_backward(corruption, self.rows_per_forward, chunk_loss, backward)
        n = len(range(0, len(corruption), max(1, self.rows_per_forward)))
        return LossOutput(torch.tensor(loss), {k: v / max(n, 1) for k, v in metrics.items()})
