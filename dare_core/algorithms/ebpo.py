"""EBPO for block diffusion (ALGORITHMS.md 5.9): the per-block composite ELBO (2.4: an independent,
stratified noise level for every (row, block) cell, all blocks corrupted at once in the two-stream
layout), one sequence ratio exp(S - S_old) clipped once in log space against the sequence advantage,
mean over sequences, optional KL on S - S_ref; gradients by proxy-gradient replay, so one row's
graph is alive at a time."""
from __future__ import annotations

from dataclasses import dataclass

from dare_core.algorithms.base import Batch, RLAlgorithm
from dare_core.algorithms.common import SequenceELBOMixin
from dare_core.algorithms.registry import register
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.mc_laws import per_block_rows, response_blocks
from dare_core.diffusion.seeding import sample_generators


@register("ebpo")
class EBPO(SequenceELBOMixin, RLAlgorithm):
    families = frozenset({"block"})

    @dataclass
    class Options:
        mc_num: int = 16
        tail_policy: str = "mask"

    def check_sampler(self, sampler) -> None:
        if self.block_size is not None and sampler.block_length != self.block_size:
            raise ValueError(f"ebpo: the rollout's block_length ({sampler.block_length}) must equal the model's block size ({self.block_size})")

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        gens = sample_generators((*seed_base, "ebpo"), batch.uids)
        blocks = response_blocks(batch.attention_mask, batch.prompt_len, self.block_size, "global")
        return per_block_rows(batch.input_ids, batch.prompt_len, batch.response_mask, batch.attention_mask[:, batch.prompt_len:],
                              self.mask_id, blocks, self.options.mc_num, gens, self.options.tail_policy)
