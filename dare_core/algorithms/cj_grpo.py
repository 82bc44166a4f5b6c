"""CJ-GRPO (docs/algorithms.md#cj-grpo): replay the rollout's own trajectory (2.6) and score the tokens each
denoising step committed, given the state before that step, at the rollout temperature.

Masked diffusion: L = (1/K) sum_k L_k, L_k a PPO (dual) clip token-mean over U_k ∩ V across the
whole mini-batch. Block diffusion: one forward per block-local step with all blocks replayed at once
in the two-stream layout; Eq. 11's reduction (token-mean inside each (sample, block, step)
transition, mean over the sample's transitions, mean over samples); the tokens decoded after EOS in
the terminal block, and those past gen_length when the terminal block runs past it, were sampled
and conditioned on, so they are replayed and scored as latent actions. Each step is its own forward
and backward, so memory does not grow with K.

With token editing a step also writes over tokens it committed earlier: every write (commit or
edit) is an action of its step, scored on the state before it (docs/algorithms.md#edited-rollouts),
and a position's scores, ratios and weights are kept per write (`replay.by_write`)."""
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
from dare_core.diffusion.replay import WriteHistory, block_local, by_write, replay_canvas, replay_rows

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
        if sampler.edit_threshold is not None:
            if self.options.step_merge:
                raise ValueError("cj_grpo's step_merge makes a block one transition, in which an edited position would "
                                 "have two actions; set step_merge: false or leave rl.sampler.edit_threshold empty")
            # a block takes at most one step a position (or its steps) plus its post-edit steps
            blocks = -(-sampler.gen_length // sampler.block_length)
            per_block = max(sampler.block_length, -(-sampler.steps // blocks)) + sampler.post_edit_steps
            self.max_steps = max(self.max_steps, blocks * per_block)

    def _replayed(self, batch: Batch) -> Batch:
        """The batch over the record's columns: a block-diffusion record keeps its terminal block
        whole, past gen_length, because the sampler decoded and attended to it there (see
        `dare_core.sampling.trajectory.record_width`). Scores, corruptions and weights are [B, P+W]
        over this canvas (W = L for masked diffusion)."""
        records = batch.records
        steps = records["step_map"].to(batch.input_ids.device)
        targets, attn = replay_canvas(batch.input_ids, batch.attention_mask, batch.prompt_len, records["decoded"], steps)
        return replace(batch, input_ids=targets, attention_mask=attn)

    def _history(self, batch: Batch) -> WriteHistory:
        """The replayed batch's writes (`_replayed`), steps numbered as the replay's rows: per block
        from 1 for block diffusion, one per block under step_merge."""
        history = WriteHistory.of_rollout_records(batch.records, batch.input_ids[:, batch.prompt_len:])
        steps = history.steps
        if self.block_size is not None:
            blocks = response_blocks(batch.attention_mask, batch.prompt_len, self.block_size, "global")
            steps = block_local(steps, blocks)
        elif self.options.step_merge:
            blocks = response_blocks(batch.attention_mask, batch.prompt_len, self.block_length, "response")
            steps = torch.where(steps > 0, blocks[..., None] + 1, steps)
        return WriteHistory(steps, history.tokens)

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        P = batch.prompt_len
        batch = self._replayed(batch)
        targets = batch.input_ids
        history = self._history(batch)
        steps = history.steps
        # masked diffusion scores V; block diffusion every decoded token (terminal-block latents,
        # after EOS or past gen_length, too)
        if self.block_size is None:
            valid = batch.response_mask.bool().to(steps.device)
            scored = torch.nn.functional.pad(valid, (0, steps.shape[1] - valid.shape[1]))
        else:
            scored = steps[..., 0] > 0
        cs = replay_rows(targets, P, history, scored, self.mask_id, targets)
        if self.block_size is not None:
            # Eq. 11 weights: 1 / (|transition| * transitions of the sample), per write
            B, W, n = steps.shape
            blocks = response_blocks(batch.attention_mask, P, self.block_size, "global")
            weight = torch.zeros(B, n, W)
            for b in range(B):
                keys = {}
                for i, j in ((steps[b] > 0) & scored[b][:, None]).nonzero().tolist():
                    keys.setdefault((int(blocks[b, i]), int(steps[b, i, j])), []).append((j, i))
                for members in keys.values():
                    js, cols = zip(*members)
                    weight[b, list(js), list(cols)] = 1.0 / (len(members) * len(keys))
            cs.info["weight"] = weight.flatten(1)
        return cs

    def _by_write(self, batch: Batch):
        """`combine` of the replayed rows' [r, B, S] values: one entry per write (`by_write`)."""
        history, P = self._history(batch), batch.prompt_len
        return lambda idx, values: by_write(values, [i + 1 for i in idx], history, P)

    def score(self, model, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        batch = self._replayed(batch)
        s = rows_logprobs(model, corruption.rows, batch.input_ids, batch.attention_mask, self.temperature, (self.mask_id,))
        return self._by_write(batch)(range(len(corruption)), s)

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
        combine = self._by_write(batch)
        if self.block_size is not None:  # Eq. 11 weights, over the number of sequences
            weight = corruption.info["weight"]
            n, W = weight.shape[1] // (batch.input_ids.shape[1] - P), batch.input_ids.shape[1] - P
            token_weight = torch.zeros(len(batch), n, P + W, device=batch.input_ids.device)
            token_weight[:, :, P:] = weight.view(len(batch), n, W).to(token_weight.device) / float(denom[0])
            token_weight = token_weight.flatten(1)
        steps_used = max(int((denom > 0).sum()), 1)

        def weight_of(idx, rows):
            scored = torch.stack([r.scored.float() for r in rows])
            if self.block_size is not None:
                return token_weight * (combine(idx, scored) > 0)
            # (1/K) * token-mean over each step's tokens in the whole mini-batch
            per_row = torch.tensor([max(float(denom[i]), 1.0) for i in idx], device=scored.device)[:, None, None]
            return combine(idx, scored / per_row) / steps_used

        return replayed_token_update(self, model, batch, corruption, old, ref, backward, weight_of, combine)
