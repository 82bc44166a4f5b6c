"""ESPO, ELBO-based sequence-level policy optimisation (docs/algorithms.md#espo): the MC-ELBO with
law (c) (l ~ U{0..n}, stratified) and, by default, the complementary-mask half that lowers its
variance; one ratio per sequence, exp((S - S_old) / L_max), clipped in log space against the
sequence advantage (RLOO in the recipe: rl.adv_estimator: rloo); KL = k2 on the raw ELBO / L_max.
Every inner iteration draws fresh masks and takes one optimiser step (rl.num_iterations: 8 in the
recipe). The loss is non-linear in the rows, so gradients come by proxy-gradient replay."""
from __future__ import annotations

from dataclasses import dataclass

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import SequenceELBOMixin
from dare_core.algorithms.registry import register_rl
from dare_core.batch import Batch
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.mc_laws import count_rows, uniform_time_rows
from dare_core.diffusion.seeding import sample_generators


@register_rl("espo")
class ESPO(SequenceELBOMixin, RLAlgorithm):
    @dataclass
    class Options:
        mc_num: int = 2
        reduce_var: bool = True  # espo_reduce_var: add the complementary-mask half of every row
        tail_policy: str = "mask"

    def check_sampler(self, sampler) -> None:
        self.ratio_scale = 1.0 / sampler.gen_length  # the sequence log-ratio and KL are per L_max

    # under uniform noise (DiffusionGemma) the rows are the uniform ELBO's stratified times
    # (`uniform_time_rows`): mc_num of them; reduce_var's complementary masks have no counterpart there
    families = frozenset({"masked", "block", "uniform"})

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        gens = sample_generators((*seed_base, "espo"), batch.uids)
        if self.kind == "uniform":
            return uniform_time_rows(batch.input_ids, batch.prompt_len, batch.response_mask, self.vocab_size, self.options.mc_num,
                                     gens, self.eos_id)
        return count_rows(batch.input_ids, batch.prompt_len, batch.response_mask, batch.attention_mask[:, batch.prompt_len:],
                          self.mask_id, self.options.mc_num, gens, with_zero=True, complement=self.options.reduce_var,
                          tail_policy=self.options.tail_policy)
