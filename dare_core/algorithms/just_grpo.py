"""JustGRPO (docs/algorithms.md#just-grpo): roll out left to right (block 1, one token per step, no cache) so
that the exact AR likelihood (2.7) is the probability the sampler drew each token with; token-level
PPO (dual) clip, token-mean over V. Scored at the rollout temperature.

The left-to-right order is the algorithm, not a decoding choice: its rollouts take rl.sampler with
block_length 1 and steps = gen_length whatever those say, while validation and evaluation decode
as configured (the paper trains in AR order and evaluates with parallel diffusion decoding)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import LossOutput, replayed_token_update
from dare_core.algorithms.registry import register_rl
from dare_core.algorithms.rollout import RolloutSpec, rollout
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import rows_logprobs
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.replay import ar_rows


@register_rl("just_grpo")
class JustGRPO(RLAlgorithm):
    families = frozenset({"masked"})

    @dataclass
    class Options:
        pass

    def check_sampler(self, sampler) -> None:
        problems = []
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

    def rollout(self, engine, tokenizer, rows: list, spec: RolloutSpec) -> tuple[Batch, dict]:
        spec = dataclasses.replace(spec, params=left_to_right(spec.params))
        return rollout(engine, tokenizer, rows, spec, self.rl.adv_estimator, self.requires)

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        return ar_rows(batch.input_ids, batch.prompt_len, batch.response_mask, self.mask_id)

    def score(self, model, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        return rows_logprobs(model, corruption.rows, batch.input_ids, batch.attention_mask, self.temperature, (self.mask_id,)).sum(0)

    def update(self, model, batch: Batch, corruption: CorruptionSet, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        def weight_of(idx, rows):  # token-mean over V of the whole mini-batch
            return torch.stack([r.scored for r in rows]).any(0).float() / float(denom[0])

        return replayed_token_update(self, model, batch, corruption, old, ref, backward, weight_of)


def left_to_right(sampler):
    """`sampler` decoding one token per step, in position order (blocks of one)."""
    return dataclasses.replace(sampler, block_length=1, steps=sampler.gen_length)
