"""EBPO for block diffusion (docs/algorithms.md#ebpo): the per-block composite ELBO (2.4: an independent,
stratified noise level for every (row, block) cell, all blocks corrupted at once in the two-stream
layout), one sequence ratio exp(S - S_old) clipped once in log space against the sequence advantage,
mean over sequences, optional KL on S - S_ref; gradients by proxy-gradient replay, so one row's
graph is alive at a time.

On a masked diffusion model (no blocks) the whole response is the one block (C = 1): the law
reduces to N stratified noise levels with uniform mask counts, the composite ELBO to the plain
stratified MC-ELBO of the response, and the loss is otherwise unchanged."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import SequenceELBOMixin
from dare_core.algorithms.registry import register_rl
from dare_core.batch import Batch
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.mc_laws import per_block_rows, response_blocks
from dare_core.diffusion.seeding import sample_generators


@register_rl("ebpo")
class EBPO(SequenceELBOMixin, RLAlgorithm):
    @dataclass
    class Options:
        mc_num: int = 16
        tail_policy: str = "mask"

    def check_sampler(self, sampler) -> None:
        if self.block_size is not None and sampler.block_length != self.block_size:
            raise ValueError(f"ebpo: the rollout's block_length ({sampler.block_length}) must equal the model's block size ({self.block_size})")

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        gens = sample_generators((*seed_base, "ebpo"), batch.uids)
        if self.block_size is None:
            blocks = torch.zeros_like(batch.response_mask, dtype=torch.long)
        else:
            blocks = response_blocks(batch.attention_mask, batch.prompt_len, self.block_size, "global")
        return per_block_rows(batch.input_ids, batch.prompt_len, batch.response_mask, batch.attention_mask[:, batch.prompt_len:],
                              self.mask_id, blocks, self.options.mc_num, gens, self.options.tail_policy)
