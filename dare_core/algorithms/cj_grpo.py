"""CJ-GRPO (docs/algorithms.md#cj-grpo): replay the rollout's own trajectory (2.6) and score the tokens each
denoising step committed, given the state before that step, at the rollout temperature.

Masked diffusion: L = (1/K) sum_k L_k, L_k a PPO (dual) clip token-mean over U_k ∩ V across the
whole mini-batch. Block diffusion: one forward per block-local step with all blocks replayed at once
in the two-stream layout; Eq. 11's reduction (token-mean inside each (sample, block, step)
transition, mean over the sample's transitions, mean over samples); the tokens decoded after EOS in
the terminal block, and those past gen_length when the terminal block runs past it, were sampled
and conditioned on, so they are replayed and scored as latent actions. Each step is its own forward
and backward, so memory does not grow with K."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import LossOutput, replay_temperature, replayed_token_update
from dare_core.algorithms.registry import register_rl
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import rows_logprobs
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.mc_laws import response_blocks
from dare_core.diffusion.replay import block_local, replay_canvas, replay_rows

log = logging.getLogger(__name__)


@register_rl("cj_grpo")
class CJGRPO(RLAlgorithm):
    requires = frozenset({"step_map", "decoded"})

    @dataclass
    class Options:
        # collapse each block's steps into one transition (K = number of blocks): cheaper, coarser
        step_merge: bool = False
        # null: the rollout's temperature (1 for greedy rollouts); 1.0 reproduces the reference
        score_temperature: Optional[float] = None

    def check_sampler(self, sampler) -> None:
        if sampler.cache != "none":
            log.warning("cj_grpo with a %s cache: the rollout's behaviour policy differs slightly from the replayed pi_old", sampler.cache)
        self.temperature = replay_temperature(sampler, self.options.score_temperature)
        self.block_length = sampler.block_length
        # a fixed number of step slots, so that every micro-batch and rank sums the same normalisers
        self.max_steps = max(sampler.steps, sampler.gen_length)

    def _replayed(self, batch: Batch) -> Batch:
        """The batch over the record's columns: a block-diffusion record keeps its terminal block
        whole, past gen_length, because the sampler decoded and attended to it there (see
        `dare_core.sampling.trajectory.record_width`). Scores, corruptions and weights are [B, P+W]
        over this canvas (W = L for masked diffusion)."""
        records = batch.records
        steps = records["step_map"].to(batch.input_ids.device)
        targets, attn = replay_canvas(batch.input_ids, batch.attention_mask, batch.prompt_len, records["decoded"], steps)
        return replace(batch, input_ids=targets, attention_mask=attn)

    def _steps(self, batch: Batch) -> torch.Tensor:
        steps = batch.records["step_map"].to(batch.input_ids.device).long()
        if self.block_size is not None:
            blocks = response_blocks(batch.attention_mask, batch.prompt_len, self.block_size, "global")
            steps = block_local(steps, blocks)
        elif self.options.step_merge:
            blocks = response_blocks(batch.attention_mask, batch.prompt_len, self.block_length, "response")
            steps = torch.where(steps > 0, blocks + 1, steps)
        return steps

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        P = batch.prompt_len
        batch = self._replayed(batch)
        targets = batch.input_ids
        steps = self._steps(batch)
        # masked diffusion scores V; block diffusion every decoded token (terminal-block latents,
        # after EOS or past gen_length, too)
        if self.block_size is None:
            valid = batch.response_mask.bool().to(steps.device)
            scored = torch.nn.functional.pad(valid, (0, steps.shape[1] - valid.shape[1]))
        else:
            scored = steps > 0
        cs = replay_rows(targets, P, steps, scored, self.mask_id, targets)
        if self.block_size is not None:
            # Eq. 11 weights: 1 / (|transition| * transitions of the sample)
            B = steps.shape[0]
            blocks = response_blocks(batch.attention_mask, P, self.block_size, "global")
            weight = torch.zeros(B, steps.shape[1])
            for b in range(B):
                keys = {}
                for i in scored[b].nonzero().squeeze(-1).tolist():
                    keys.setdefault((int(blocks[b, i]), int(steps[b, i])), []).append(i)
                for members in keys.values():
                    weight[b, members] = 1.0 / (len(members) * len(keys))
            cs.info["weight"] = weight
        return cs

    def score(self, model, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        batch = self._replayed(batch)
        return rows_logprobs(model, corruption.rows, batch.input_ids, batch.attention_mask, self.temperature, (self.mask_id,)).sum(0)

    def denominator(self, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        if self.block_size is not None:
            return torch.tensor([float(len(batch))], dtype=torch.float64)
        counts = torch.zeros(self.max_steps, dtype=torch.float64)
        for k, row in enumerate(corruption.rows):
            counts[k] = float(row.scored.sum())
        return counts

    def update(self, model, batch: Batch, corruption: CorruptionSet, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        P = batch.prompt_len
        batch = self._replayed(batch)
        if self.block_size is not None:  # Eq. 11 weights, over the number of sequences
            token_weight = torch.zeros_like(batch.input_ids, dtype=torch.float32)
            token_weight[:, P:] = corruption.info["weight"].to(token_weight.device) / float(denom[0])
        steps_used = max(int((denom > 0).sum()), 1)

        def weight_of(idx, rows):
            if self.block_size is not None:
                return token_weight * torch.stack([r.scored for r in rows]).any(0)
            # (1/K) * token-mean over each step's tokens in the whole mini-batch
            return sum(r.scored.float() / max(float(denom[i]), 1.0) for i, r in zip(idx, rows)) / steps_used

        return replayed_token_update(self, model, batch, corruption, old, ref, backward, weight_of)
