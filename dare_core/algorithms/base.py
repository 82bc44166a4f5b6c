"""The Algorithm interface: what an objective needs from a batch, and its loss.

An algorithm never builds masks or calls the model for likelihoods itself: it asks
`diffusion.masking` for a corruption and `diffusion.likelihood` for scores, and the RL loop hands
the same corruption to old, reference and current policy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch

from dare_core.algorithms.common import LossOutput
from dare_core.algorithms.registry import RL_ALGORITHMS
from dare_core.algorithms.rollout import RolloutSpec, rollout
from dare_core.batch import Batch
from dare_core.rl_rules import check_algorithm_fits, model_kind


class Algorithm(ABC):
    """Base of every objective: its name and its `Options`, a dataclass of its own config keys.
    Each kind is built from other things and has its own registry (algorithms/registry.py)."""

    name: ClassVar[str]
    Options: ClassVar[type]

    def __init__(self, options):
        self.options = options


class RLAlgorithm(Algorithm):
    """One RL objective. The loop calls, per rollout batch: `prepare` (after rewards), `corrupt` per
    inner iteration, `score` under the old and reference policies (no grad, same corruptions), then
    per micro-batch `update`, which computes the loss and calls `backward` (once, or once per chunk
    of Monte-Carlo rows so memory stays flat); `denominator` gives the global normalisers that make
    the gradient independent of the micro-batch split (5.1.3)."""

    #: rollout records the algorithm needs beyond token ids: "step_map" and "decoded" (CJ-GRPO), or
    #: "x0_hat" / "confidence" (MDPO), which make the sampler record every step in full
    requires: ClassVar[frozenset] = frozenset()
    #: model kinds the estimator is defined for: "masked" (LLaDA, Dream), "block" (SDAR, LLaDA2),
    #: "uniform" (uniform noise, no mask token: DiffusionGemma; rl_rules.model_kind)
    families: ClassVar[frozenset] = frozenset({"masked", "block"})
    #: token-level estimators have an entropy and a token count; sequence-level ones do not
    token_level: ClassVar[bool] = True
    #: may the objective carry a KL term to the reference (SPG forbids it)
    allows_kl: ClassVar[bool] = True
    #: every score goes through diffusion/likelihood.py `token_logprobs`, which runs sequence-parallel
    #: (launch.sequence_parallel); one that reads the model's logits another way cannot
    sequence_parallel: ClassVar[bool] = True
    #: the objective scores only valid response positions (up to each rollout's stop token) and
    #: corrupts each of them independently of what follows: on block diffusion the canvas after the
    #: stop token's block is then left out of scoring and training (diffusion/block.py through_stop_block)
    scores_within_stop: ClassVar[bool] = False
    #: why the algorithm cannot train on rollouts with token editing (rl.sampler.edit_threshold);
    #: empty: it can (docs/algorithms.md#edited-rollouts)
    refuses_editing: ClassVar[str] = ""

    def __init__(self, options, rl_cfg, model):
        super().__init__(options)
        self.rl = rl_cfg
        self.mask_id = model.mask_token_id
        self.eos_id = model.eos_token_id
        self.block_size = model.block_size
        self.kind = model_kind(model)
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)  # (uniform noise draws from it)
        check_algorithm_fits(type(self), rl_cfg, self.kind, RL_ALGORITHMS)
        self.check_sampler(rl_cfg.sampler)

    def check_sampler(self, sampler) -> None:
        """Refuse a rollout sampler the estimator cannot be exact for (configuration time)."""

    @property
    def rows_per_forward(self) -> int:
        return self.rl.rows_per_forward

    @property
    def rows_per_prompt(self) -> int:
        """Training-batch rows one prompt yields: its G rollouts, or (d-TreeRPO) its tree's
        transitions. The loop sizes mini- and micro-batches from it."""
        return self.rl.group_size

    def rollout(self, engine, tokenizer, rows: list, spec: RolloutSpec) -> tuple[Batch, dict]:
        """Rollouts of `rows` (G per prompt) from the rollout `engine`, rewarded, as a training batch
        with advantages. Another order (JustGRPO) or shape (d-TreeRPO's tree) overrides it."""
        return rollout(engine, tokenizer, rows, spec, self.rl.adv_estimator, self.requires, self.trims_after_stop)

    @property
    def trims_after_stop(self) -> bool:
        """Whether its rollouts' canvas after the stop token's block is dropped: exact only where no
        earlier position sees it (block diffusion on blocks of absolute positions); masked diffusion
        attends over the whole canvas. (DiffusionGemma's canvases start at each response: not yet.)"""
        return self.scores_within_stop and self.kind == "block"

    def prepare(self, batch: Batch, context) -> dict:
        """After the rollout is rewarded: e.g. per-step rewards and advantages (MDPO). Metrics."""
        return {}

    @abstractmethod
    def corrupt(self, batch: Batch, seed_base: tuple):
        """The corruption of one inner iteration (seed_base = (run_seed, step, iteration)): a
        `Corruption` or `CorruptionSet` (anything with `select(idx)`)."""

    @abstractmethod
    def score(self, model, batch: Batch, corruption) -> torch.Tensor:
        """Scores under `model` (float32, batch dim first) that old / reference evaluations store."""

    def denominator(self, batch: Batch, corruption) -> torch.Tensor:
        """This part's share of the global normalisers (summed over micro-batches and ranks before
        any backward): by default the number of scored tokens (token-mean)."""
        return torch.tensor([float(corruption.scored.sum())], dtype=torch.float64)

    @abstractmethod
    def update(self, model, batch: Batch, corruption, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               denom: torch.Tensor, backward) -> LossOutput:
        """Loss of a micro-batch, backpropagated through `backward` (old None: one update per
        rollout batch, pi_old is the current policy). Returns the (detached) loss and metrics."""
