"""Ulysses sequence parallelism: its collectives.

The N ranks of a sequence-parallel group each hold 1/N of every sequence (a contiguous slice of
the sequence dimension). Everything outside attention is per token, so it runs on the slice as it
is; attention needs every key, so before it an all-to-all trades the slices of all heads for all
of the sequence of 1/N of the heads, and after it the inverse all-to-all trades back. Each
all-to-all's backward is the other one, so gradients flow through both exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from dare_core.models.compiled import outside_graphs


@dataclass(frozen=True)
class SequenceShards:
    """This rank's place in a sequence-parallel group: `size` ranks, this one `rank` (its index in
    `group`), holding positions [rank * S / size, (rank + 1) * S / size) of every sequence."""

    group: object  # torch.distributed ProcessGroup (None: the default group)
    size: int
    rank: int

    @classmethod
    def of(cls, group=None) -> "SequenceShards":
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def check(self, n_heads: int, n_kv_heads: int, seq_len: Optional[int] = None) -> None:
        """ValueError unless the heads, the key/value heads and the sequence (where given) split evenly."""
        for count, what in ((n_heads, "the number of attention heads"), (n_kv_heads, "the number of key/value heads"),
                            (seq_len or 0, "the sequence length (pad the batch to a multiple of it)")):
            if count % self.size:
                raise ValueError(f"launch.sequence_parallel ({self.size}) must divide {what}, {count}: each rank of a "
                                 f"sequence-parallel group takes an equal share")

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of the full-length `x` along `dim`."""
        return x.chunk(self.size, dim=dim)[self.rank]


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all over dim 0 ([N, ...]: chunk j goes to rank j; chunk j of the result came from rank j)."""
    x = x.contiguous()  # first: empty_like keeps a permuted view's strides, which the collective ignores
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _sequence_to_heads(x: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """[B, H, S/N, D] (all heads, this rank's slice) -> [B, H/N, S, D] (this rank's heads, all of it)."""
    b, h, s, d = x.shape
    n = shards.size
    parts = x.view(b, n, h // n, s, d).permute(1, 0, 2, 3, 4)  # [N(head chunk -> rank), B, H/N, S/N, D]
    got = _exchange(parts, shards.group)  # [N(sequence slice of rank j), B, H/N, S/N, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_sequence(x: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """[B, H/N, S, D] -> [B, H, S/N, D]: the inverse of `_sequence_to_heads`."""
    b, h, s, d = x.shape
    n = shards.size
    parts = x.view(b, h, n, s // n, d).permute(2, 0, 1, 3, 4)  # [N(sequence slice -> rank), B, H/N, S/N, D]
    got = _exchange(parts, shards.group)  # [N(head chunk of rank j), B, H/N, S/N, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, h * n, s // n, d)


class _Trade(torch.autograd.Function):
    """One of the two all-to-alls (`to_heads`: sequence -> heads); its backward is the other."""

    @staticmethod
    def forward(ctx, x, shards, to_heads):
        ctx.shards, ctx.to_heads = shards, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, shards)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_sequence if ctx.to_heads else _sequence_to_heads)(grad, ctx.shards), None, None


# under `model.compile` the collectives stay out of the traced layer graphs, as the attention kernels do
@outside_graphs
def sequence_to_heads(x: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """[B, H, S/N, D] -> [B, H/N, S, D], differentiable (its backward is `heads_to_sequence`)."""
    return _Trade.apply(x, shards, True)


@outside_graphs
def heads_to_sequence(x: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """[B, H/N, S, D] -> [B, H, S/N, D], differentiable (its backward is `sequence_to_heads`)."""
    return _Trade.apply(x, shards, False)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shards, dim):
        ctx.shards, ctx.dim = shards, dim
        parts = [torch.empty_like(x) for _ in range(shards.size)]
        dist.all_gather(parts, x.contiguous(), group=shards.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.shards.local(grad, ctx.dim).contiguous(), None, None


def gather_sequence(x: torch.Tensor, shards: SequenceShards, dim: int = 1) -> torch.Tensor:
    """The full-length tensor from every rank's slice along `dim`, differentiable under the
    convention that every rank of the group computes the same loss from it: each rank's backward
    keeps its own slice of the gradient, so summing the parameter gradients over the group (what
    the gradient all-reduce does) gives the gradient of that one loss."""
    return _GatherSequence.apply(x, shards, dim)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shards):
        out = x.clone()
        dist.all_reduce(out, group=shards.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_group(x: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """The sum of every rank's `x` (each rank's part zero where another rank's is not), on every
    rank of the group, differentiable under `gather_sequence`'s convention: every rank computes the
    same loss from the sum, and each rank's backward passes the loss's gradient to its own part
    alone (the identity), so the group's parameter gradients sum to that one loss's gradient."""
    return _SumOverGroup.apply(x, shards)
