"""The Algorithm interface: what an objective needs from a batch, and its loss.

An algorithm never builds masks or calls the model for likelihoods itself: it asks
`diffusion.masking` for a corruption and `diffusion.likelihood` for scores, and the RL loop hands
the same corruption to old, reference and current policy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from dare_core.diffusion.masking import Corruption


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict = field(default_factory=dict)


@dataclass
class Batch:
    """Left-padded prompt (P) + response canvas (L) for a group of sequences."""

    input_ids: torch.Tensor  # [B, P+L]
    attention_mask: torch.Tensor  # [B, P+L]
    prompt_len: int
    response_mask: torch.Tensor  # [B, L] maskable / scored response positions
    uids: list  # per-sample ids: seeds derive from them, never from batch position
    advantages: Optional[torch.Tensor] = None  # [B] (RL only)
    # rollout records an algorithm asked for (`RLAlgorithm.requires`), each a tensor with a batch dim
    # first, e.g. "step_map" [B, L] (ALGORITHMS.md 6.5)
    records: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "Batch":
        return Batch(
            self.input_ids[idx], self.attention_mask[idx], self.prompt_len, self.response_mask[idx],
            [self.uids[i] for i in idx.tolist()], None if self.advantages is None else self.advantages[idx],
            {k: v[idx.to(v.device)] for k, v in self.records.items()},
        )


class Algorithm(ABC):
    """Base of every objective. `Options` is a dataclass of the algorithm's own config keys."""

    name: ClassVar[str]
    Options: ClassVar[type]

    def __init__(self, options):
        self.options = options


class RLAlgorithm(Algorithm):
    #: rollout records the algorithm needs beyond token ids: "step_map" (CJ-GRPO, d-TreeRPO), or
    #: "x0_hat" / "confidence" (MDPO), which make the sampler record every step in full
    requires: ClassVar[frozenset] = frozenset()

    def __init__(self, options, rl_cfg, mask_id: int, eos_id: int):
        super().__init__(options)
        self.rl = rl_cfg
        self.mask_id = mask_id
        self.eos_id = eos_id

    @abstractmethod
    def corrupt(self, batch: Batch, seed_base: tuple) -> Corruption:
        """The corruption of one inner iteration (seed_base = (run_seed, step, iteration))."""

    @abstractmethod
    def score(self, model, batch: Batch, corruption: Corruption) -> torch.Tensor:
        """Per-token scores [B, P+L] (float32) under `model` for this corruption."""

    @abstractmethod
    def loss(self, model, batch: Batch, corruption: Corruption, old: torch.Tensor, ref: Optional[torch.Tensor], denom: float) -> LossOutput:
        """The loss of a micro-batch; `denom` is the global normaliser of the whole mini-batch."""
