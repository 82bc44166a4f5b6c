"""Preference optimisation of diffusion LMs (docs/algorithms.md#preference-optimisation): ELBO-DPO and VRPO.

Both minimise, averaged over pairs (prompt x, chosen y_w, rejected y_l),

    L = -logsigmoid( beta * [ (B_theta(y_w) - B_ref(y_w)) - (B_theta(y_l) - B_ref(y_l)) ] )

in float32, where B_pi(y) = (1/N) sum_j E_j / Z is the Monte-Carlo ELBO of 2.3: row j masks a
uniform l_j-subset S_j of the valid region V (law 1.3 (b), weight n/l_j on each masked token),
E_j = sum_{i in S_j} (n/l_j) log p_pi(y_i | z_j), and Z = pad_to (`elbo_norm: fixed`, so that beta
means the same thing in every batch) or 1 (`none`, the paper's form, which wants a much smaller
beta). The bracket is the DPO logit, which is also the implicit reward margin that is logged.

The two objectives differ only in how the N corruptions are drawn:

- `elbo_dpo` (plain ELBO-DPO, the ablation): each row draws its own l_j ~ U{1..n}, independently
  of the other rows (no stratification), and the reference draws its own rows, independent of the
  policy's (`shared_masks = False`). B_theta - B_ref then carries the full variance of two
  independent estimates, even at initialisation.
- `vrpo` (LLaDA 1.5): budget n = mc_num with the optimal allocation n_t = n timesteps and n_y = 1
  mask each; the l_j are stratified over {1..n} (`stratified = True`); and the reference scores
  exactly the policy's rows (t_j, S_j) (`shared_masks = True`, antithetic sampling). At
  pi_theta = pi_ref the logit is then exactly 0 for every mask draw.

Both flags can be set on their own for ablations (`preference.shared_masks`,
`preference.stratified`). In every case chosen and rejected draw independent masks (generators of
different purposes), and every mask comes from a generator seeded by (run_seed, step, purpose, pair
uid) (1.6): no global RNG, and a pair's masks do not depend on its batch neighbours, its position in
the batch or the micro-batch split.

Reference ELBOs are computed once per batch on the stored masks, without a graph; the policy
recomputes its own on the same masks (`update`). The loss depends on the rows only through their
mean, non-linearly, so the gradient is taken with the exact proxy-gradient replay of 2.3
(`proxy_backward`): activation memory is that of `rows_per_forward` rows whatever mc_num. The
reference ELBOs are computed with the same row chunks as the policy's value pass, so at
pi_theta = pi_ref both are bitwise equal.

Layout: P pairs are a batch of 2P sequences, chosen at even rows and rejected at odd rows, with one
prompt length and one canvas (`dare_core.data.batching.pair_batch`); `Batch.uids` holds the pair uid
on both rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F

from dare_core.algorithms.base import Algorithm
from dare_core.algorithms.common import LossOutput
from dare_core.algorithms.registry import get_preference, register_preference
from dare_core.batch import Batch
from dare_core.diffusion.likelihood import chunks, elbo_rows, proxy_backward
from dare_core.diffusion.masking import CorruptionSet, valid_region
from dare_core.diffusion.mc_laws import TAIL_POLICIES, count_rows
from dare_core.diffusion.seeding import generator
ELBO_NORMS = ("fixed", "none")
ROLES = ("chosen", "rejected")


@dataclass
class PairCorruption:
    """The masks of one batch of pairs: the policy's rows and the reference's (the very same
    object under shared masks)."""

    policy: CorruptionSet
    reference: CorruptionSet

    @property
    def shared(self) -> bool:
        return self.reference is self.policy


@dataclass
class PreferenceOutput(LossOutput):
    """The micro-batch loss (already divided by the global number of pairs), metrics summed over
    its pairs, and the per-pair DPO logits (detached)."""

    logits: Optional[torch.Tensor] = None


@register_preference("elbo_dpo")
class ElboDPO(Algorithm):
    """Plain ELBO-DPO: i.i.d. rows, reference on its own independent masks (see the module doc)."""

    #: the reference is scored on the policy's masks (antithetic sampling)
    shared_masks: ClassVar[bool] = False
    #: the N rows' mask counts are stratified over {1..n}
    stratified: ClassVar[bool] = False

    @dataclass
    class Options:
        beta: float = 0.2
        mc_num: int = 4
        elbo_norm: str = "fixed"
        tail_policy: str = "mask"
        rows_per_forward: int = 4
        shared_masks: Optional[bool] = None  # None: the algorithm's own setting
        stratified: Optional[bool] = None

    def __init__(self, options, model, pad_to: int):
        super().__init__(options)
        if options.elbo_norm not in ELBO_NORMS:
            raise ValueError(f"preference.elbo_norm must be one of {ELBO_NORMS}, got '{options.elbo_norm}'")
        if options.tail_policy not in TAIL_POLICIES:
            raise ValueError(f"preference.tail_policy must be one of {TAIL_POLICIES}, got '{options.tail_policy}'")
        if options.mc_num < 1 or options.rows_per_forward < 1:
            raise ValueError("preference.mc_num and preference.rows_per_forward must be >= 1")
        if options.beta <= 0:
            raise ValueError(f"preference.beta must be > 0, got {options.beta}")
        if options.shared_masks is not None:
            self.shared_masks = options.shared_masks
        if options.stratified is not None:
            self.stratified = options.stratified
        self.mask_id = model.mask_token_id
        self.eos_id = model.eos_token_id
        self.pad_to = pad_to
        # Z of 2.3: a constant from config, never a per-batch quantity (that would rescale beta)
        self.z = float(pad_to) if options.elbo_norm == "fixed" else 1.0

    # ------------------------------------------------------------------ masks

    def _generators(self, batch: Batch, seed_base: tuple, stream: str, mc: Optional[int], share_pair: bool) -> list:
        out = []
        for i, uid in enumerate(batch.uids):
            role = "pair" if share_pair else ROLES[i % 2]
            parts = (*seed_base, "preference", stream, role) + (() if mc is None else (mc,)) + (uid,)
            out.append(generator(*parts))
        return out

    def _draw(self, batch: Batch, seed_base: tuple, stream: str, share_pair: bool) -> CorruptionSet:
        P = batch.prompt_len
        canvas = batch.attention_mask[:, P:].bool()
        valid = valid_region(batch.input_ids[:, P:], self.eos_id, canvas)
        args = (batch.input_ids, P, valid, canvas, self.mask_id)
        if self.stratified:
            gens = self._generators(batch, seed_base, stream, None, share_pair)
            return count_rows(*args, self.options.mc_num, gens, tail_policy=self.options.tail_policy)
        rows = []
        for j in range(self.options.mc_num):  # one law-(b) draw per row from its own generator
            gens = self._generators(batch, seed_base, stream, j, share_pair)
            rows += count_rows(*args, 1, gens, tail_policy=self.options.tail_policy).rows
        return CorruptionSet(rows)

    def corrupt(self, batch: Batch, seed_base: tuple, share_pair: bool = False) -> PairCorruption:
        """The masks of one optimiser step (seed_base = (run_seed, step)). `share_pair` gives the
        rejected row the chosen row's masks (a diagnostic: the objectives never do this)."""
        policy = self._draw(batch, seed_base, "policy", share_pair)
        reference = policy if self.shared_masks else self._draw(batch, seed_base, "reference", share_pair)
        return PairCorruption(policy, reference)

    # ------------------------------------------------------------------ scores

    def row_elbos(self, model, batch: Batch, rows: CorruptionSet, idx: list) -> torch.Tensor:
        """E_j / Z for the rows `idx`: [2P, len(idx)], float32."""
        return elbo_rows(model, [rows.rows[i] for i in idx], batch.input_ids, batch.attention_mask) / self.z

    def sequence_elbos(self, model, batch: Batch, rows: CorruptionSet) -> torch.Tensor:
        """B = mean_j E_j / Z per sequence: [2P], in the same row chunks as the policy's value pass."""
        parts = [self.row_elbos(model, batch, rows, idx) for idx in chunks(len(rows), self.options.rows_per_forward)]
        return torch.cat(parts, dim=1).mean(1)

    def reference_elbos(self, ref_model, batch: Batch, corruption: PairCorruption) -> torch.Tensor:
        """B_ref on the reference's stored masks, no graph: [2P]."""
        with torch.no_grad():
            return self.sequence_elbos(ref_model, batch, corruption.reference)

    def pair_logits(self, policy_elbos: torch.Tensor, ref_elbos: torch.Tensor) -> torch.Tensor:
        """beta * [(B_theta - B_ref)(y_w) - (B_theta - B_ref)(y_l)] per pair, float32: [P]."""
        d = policy_elbos.float() - ref_elbos.float().to(policy_elbos.device)
        return self.options.beta * (d[0::2] - d[1::2])

    # ------------------------------------------------------------------ loss

    def update(self, model, batch: Batch, corruption: PairCorruption, ref_elbos: torch.Tensor, n_pairs: float,
               backward) -> PreferenceOutput:
        """Loss of one micro-batch of whole pairs, divided by the global number of pairs `n_pairs`
        (so the gradient does not depend on the micro-batch split), backpropagated through
        `backward` chunk by chunk of rows. Metrics are sums over this micro-batch's pairs."""
        if len(batch) % 2:
            raise ValueError("a preference batch holds whole pairs (chosen, rejected), got an odd number of rows")
        n_pairs = max(float(n_pairs), 1.0)
        captured = {}

        def stats(idx):
            return self.row_elbos(model, batch, corruption.policy, idx)

        def loss_of(rows: torch.Tensor):
            logits = self.pair_logits(rows.mean(1), ref_elbos)
            captured["logits"] = logits.detach()
            loss = -F.logsigmoid(logits).sum() / n_pairs
            return loss, {}

        loss, _ = proxy_backward(corruption.policy, self.options.rows_per_forward, stats, loss_of, backward)
        logits = captured["logits"]
        metrics = {
            "reward_margin": float(logits.sum()),
            "reward_accuracy": float((logits > 0).sum()),
            "pairs": float(logits.numel()),
        }
        return PreferenceOutput(loss.detach(), metrics, logits)


@register_preference("vrpo")
class VRPO(ElboDPO):
    """VRPO: ELBO-DPO with stratified timesteps (one mask each) and the reference on the policy's
    masks (see the module doc)."""

    shared_masks = True
    stratified = True


def build_preference(pcfg, model) -> ElboDPO:
    """The configured preference objective for `model` (pcfg: the `preference` config section)."""
    from dare_core.config import from_dict

    cls = get_preference(pcfg.algorithm)
    keys = ("beta", "mc_num", "elbo_norm", "tail_policy", "rows_per_forward", "shared_masks", "stratified")
    options = from_dict(cls.Options, {k: getattr(pcfg, k) for k in keys}, "preference")
    return cls(options, model, pcfg.pad_to)
