"""The training batch every objective reads: left-padded prompts plus a response canvas. Data
batching builds it, rollouts fill it, algorithms and estimators read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


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
    # first, e.g. "step_map" [B, L] ([B, L + block_size - 1] on block diffusion: the terminal block
    # past gen_length as the sampler decoded it; docs/sampling.md#rollout-records)
    records: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "Batch":
        """The batch with every tensor (records included) on `device`."""
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.prompt_len, self.response_mask.to(device),
                     list(self.uids), None if self.advantages is None else self.advantages.to(device),
                     {k: v.to(device) for k, v in self.records.items()})

    def select(self, idx: torch.Tensor) -> "Batch":
        return Batch(
            self.input_ids[idx], self.attention_mask[idx], self.prompt_len, self.response_mask[idx],
            [self.uids[i] for i in idx.tolist()], None if self.advantages is None else self.advantages[idx],
            {k: v[idx.to(v.device)] for k, v in self.records.items()},
        )
