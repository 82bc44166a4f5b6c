"""Coupled-GRPO (DiffuCoder, docs/algorithms.md#coupled-grpo): the coupled three-pass estimator (2.2) with a fresh
(t, u) per sample per inner iteration from explicit generators, token-level PPO like d1, RLOO
advantages without std scaling in the paper's recipe (set rl.adv_estimator: rloo)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import LossOutput, token_policy_loss, wants_entropy
from dare_core.algorithms.registry import register_rl
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import rows_logprobs
from dare_core.diffusion.masking import CorruptionSet
from dare_core.diffusion.mc_laws import coupled_rows
from dare_core.diffusion.seeding import sample_generators


@register_rl("coupled_grpo")
class CoupledGRPO(RLAlgorithm):
    @dataclass
    class Options:
        t_min: float = 0.2
        t_max: float = 0.8
        # the released form: the full-mask pass F plus the A/B pair, halved; false = the pure pair
        include_full: bool = True
        tail_policy: str = "mask"

    def corrupt(self, batch: Batch, seed_base: tuple) -> CorruptionSet:
        o = self.options
        gens = sample_generators((*seed_base, "coupled"), batch.uids)
        canvas = batch.attention_mask[:, batch.prompt_len:]
        return coupled_rows(batch.input_ids, batch.prompt_len, batch.response_mask, canvas, self.mask_id, gens,
                            o.t_min, o.t_max, o.include_full, o.tail_policy)

    def score(self, model, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        """s_i = 1/2 [log p(y_i|z_F) + 1[i in A]/t log p(y_i|z_A) + 1[i in B]/(1-t) log p(y_i|z_B)]."""
        return self._combine(rows_logprobs(model, corruption.rows, batch.input_ids, batch.attention_mask), corruption)

    @staticmethod
    def _combine(logp: torch.Tensor, corruption: CorruptionSet) -> torch.Tensor:
        weight = torch.stack([r.elbo_weight() for r in corruption.rows]).to(logp.device)
        return 0.5 * (logp * weight).sum(0)

    def denominator(self, batch: Batch, corruption: CorruptionSet) -> torch.Tensor:
        return torch.tensor([float(batch.response_mask.sum())], dtype=torch.float64)

    def update(self, model, batch: Batch, corruption: CorruptionSet, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        entropy = None
        if wants_entropy(self.rl):
            logp, ent = rows_logprobs(model, corruption.rows, batch.input_ids, batch.attention_mask, entropy=True)
            s = self._combine(logp, corruption)
            # a token's entropy: the mean over the passes that score it (F and one of A / B), the
            # estimator's 1/t weights are for the likelihood's unbiasedness, not the entropy's
            scored = torch.stack([r.scored for r in corruption.rows]).to(ent.device).float()
            entropy = ent.sum(0) / scored.sum(0).clamp_min(1)
        else:
            s = self.score(model, batch, corruption)
        mask = corruption.scored.float()
        loss, metrics = token_policy_loss(s, old, ref, batch.advantages[:, None].to(s), mask, float(denom[0]), self.rl, entropy)
        backward(loss)
        metrics["t_mean"] = float(corruption.info["t"].mean())
        return LossOutput(loss.detach(), metrics)
