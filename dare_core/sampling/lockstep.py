"""Decoding in step across ranks, for models whose weights ZeRO-3 partitions.

Under ZeRO-3 a forward pass gathers each layer's weights from every rank (a collective), so all
ranks must make the same sequence of forward calls. Decoding that stops when its rows are done
(threshold, dynamic and entropy-bounded unmasking; EOS ending a sequence early) makes a
data-dependent number of calls: a rank whose rows finish first would leave the others waiting in
their next gather until the process group's timeout. The denoising loop (`decode.generate`)
therefore asks the ranks, at each point where it would stop, whether any of them goes on (one
all-reduce of one number), and a rank with nothing left to decode makes the same forward call on
rows it keeps frozen in its batch, discarding the logits. Its own rows decode exactly as they would
alone: an idle step draws no random numbers and commits nothing. See docs/sampling.md ("Several ranks under ZeRO-3").
"""
from __future__ import annotations

from typing import Optional

import torch


def zero3_partitioned(model: torch.nn.Module) -> bool:
    """Whether a forward of `model` gathers weights from other ranks: DeepSpeed's ZeRO-3 marks each
    parameter it manages with a `ds_id`, and one of which this rank holds only its shard is
    NOT_AVAILABLE. Inside `engine.rollout_weights` every parameter is whole (and the gather hooks
    are off), so decoding there needs no lockstep."""
    return any(hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", "") == "NOT_AVAILABLE"
               for p in model.parameters())


class RankLockstep:
    """The ranks' agreement on where decoding goes on: `any` (does any rank still decode?) and
    `max` (the most blocks any rank's canvas has). Each call is a collective: every rank makes it
    at the same point of the loop."""

    def __init__(self, device: torch.device | str, group: Optional[object] = None):
        # NCCL reduces GPU tensors only; gloo CPU tensors
        self.device = torch.device(device)
        self.group = group
        self.calls = 0  # collectives made, for tests and diagnostics

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> Optional["RankLockstep"]:
        """A lockstep for `model` when it is partitioned by ZeRO-3 across several ranks, else None
        (each rank then holds its whole weights and decodes on its own)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return None
        if not zero3_partitioned(model):
            return None
        return cls(next(model.parameters()).device)

    def _reduce_max(self, value: int) -> int:
        self.calls += 1
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def any(self, flag: bool) -> bool:
        return bool(self._reduce_max(int(bool(flag))))

    def max(self, value: int) -> int:
        return self._reduce_max(int(value))
