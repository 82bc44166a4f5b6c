"""Packed (padding-free) training forwards.

A padded batch [B, S] spends compute on every padding token; a packed forward runs only the real
tokens, laid back to back in one stream, with positions restarting per sequence and no attention
across sequences. For a bidirectional family this is exactly the padded computation (each real
token sees the same keys at the same positions), so packing changes the cost, not the result.

`model.packing` chooses: `off` (padded SDPA), `on` (packed everywhere; on CPU through SDPA with a
block-diagonal mask, which is how the CPU tests pin packed = padded), `auto` (packed where a packed
kernel runs: varlen for bidirectional families and FlexAttention for block diffusion on CUDA;
padded on CPU, where a dense block-diagonal mask saves nothing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PACKING_MODES = ("auto", "on", "off")


def packed_backend(mode: str, device: torch.device, block_diffusion: bool) -> Optional[str]:
    """The attention backend of a packed forward, or None for a padded one."""
    if mode not in PACKING_MODES:
        raise ValueError(f"model.packing must be one of {list(PACKING_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    if device.type != "cuda":
        return "sdpa" if mode == "on" else None
    return "flex" if block_diffusion else "varlen"


@dataclass
class PackedLayout:
    """Where each real token of a padded [B, S] batch sits in the packed stream of T tokens."""

    valid: torch.Tensor  # bool [B, S]: the real tokens (attention_mask)
    lens: list  # real tokens per row
    index: torch.Tensor  # long [B, S]: packed position of (b, i); -1 at padding
    positions: torch.Tensor  # long [T]: rank of each token in its row (the padded positions)

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "PackedLayout":
        valid = attention_mask.bool()
        counts = valid.sum(-1)
        flat = valid.reshape(-1)
        index = (flat.long().cumsum(0) - 1).masked_fill(~flat, -1).view_as(valid)
        # the rank among a row's real tokens: what default_position_ids gives a padded batch
        positions = (valid.long().cumsum(-1) - 1)[valid]
        return cls(valid, counts.tolist(), index, positions)

    def sources(self, rows: torch.Tensor, shifted: bool) -> torch.Tensor:
        """Packed index of the hidden state that predicts each position of the boolean [B, S] `rows`
        (row-major): its own, or for a shifted family the previous real token's (a sequence's first
        token reads its own), as in the padded forward of any contiguous mask."""
        index = self.index[rows]
        if shifted:
            first = self.positions[index] == 0
            index = torch.where(first, index, index - 1)
        return index

    @property
    def total(self) -> int:
        return int(self.positions.numel())

    def starts(self) -> torch.Tensor:
        """Packed position of each row's first token [B]."""
        lens = torch.tensor(self.lens, device=self.positions.device)
        return torch.cumsum(lens, 0) - lens
