"""How the ranks divide the work: data parallelism over groups of `launch.sequence_parallel` ranks.

Ranks are grouped consecutively ([0..N-1], [N..2N-1], ...; the ranks of one node, whose all-to-alls
are the fastest) into sequence-parallel groups: the ranks of a group see the same batch, hold 1/N
of each of its sequences in the scoring forwards, and sum their scores (dare_core/models/ulysses.py).
Each group is one data-parallel unit: the data, the global denominators and the per-rank metrics
split and combine over the `dp_size` groups, `dp_rank` being this rank's group. With N = 1 every
rank is its own group and the layout is plain data parallelism (docs/diffusion.md#sequence-parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.config import LaunchConfig
from dare_core.models.ulysses import SequenceShards


@dataclass(frozen=True)
class ParallelLayout:
    sp_size: int = 1
    sp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    sp_group: object = None  # this rank's sequence-parallel group (None when sp_size is 1)
    dp_group: object = None  # the ranks holding the same slice in every group (None: the world, or one rank)

    @property
    def shards(self) -> Optional[SequenceShards]:
        """This rank's place in its sequence-parallel group; None without sequence parallelism."""
        return SequenceShards(self.sp_group, self.sp_size, self.sp_rank) if self.sp_size > 1 else None


_layout = ParallelLayout()


def planned_layout(sequence_parallel: int, world: int, rank: int) -> ParallelLayout:
    """The layout of `rank` of `world` ranks in groups of `sequence_parallel`, without its groups
    (known before the process group starts, for the stages' checks)."""
    if world % sequence_parallel:
        raise ValueError(f"launch.sequence_parallel ({sequence_parallel}) must divide the {world} ranks")
    return ParallelLayout(sequence_parallel, rank % sequence_parallel, world // sequence_parallel, rank // sequence_parallel)


def init_layout(sequence_parallel: int) -> ParallelLayout:
    """Make this rank's groups (once; every rank calls it, after the process group exists) and
    make the layout current (`layout()`)."""
    global _layout
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = planned_layout(sequence_parallel, world, rank)
    if (plan.sp_size, plan.dp_size) == (_layout.sp_size, _layout.dp_size):
        return _layout
    sp_group = dp_group = None
    if plan.sp_size > 1:
        # every rank makes every group, in the same order (new_group is collective over the world)
        for g in range(plan.dp_size):
            group = dist.new_group(list(range(g * plan.sp_size, (g + 1) * plan.sp_size)))
            sp_group = group if g == plan.dp_rank else sp_group
        for j in range(plan.sp_size):
            group = dist.new_group(list(range(j, world, plan.sp_size)))
            dp_group = group if j == plan.sp_rank else dp_group
    _layout = ParallelLayout(plan.sp_size, plan.sp_rank, plan.dp_size, plan.dp_rank, sp_group, dp_group)
    return _layout


def layout() -> ParallelLayout:
    """The current layout (plain data parallelism until `init_layout` makes another)."""
    return _layout


def check_sequence_parallel(launch: LaunchConfig, model, algorithm: Optional[object] = None) -> None:
    """Before a stage trains: ValueError unless launch.sequence_parallel divides the model's
    attention and key/value heads (`model`: a DiffusionLM, perhaps on the meta device) and the RL
    `algorithm` (where given) scores through the sequence-parallel path. The sequence length needs
    no check: the scoring forwards pad it (models/sequence_parallel.py `pad_for_shards`)."""
    n = launch.sequence_parallel
    if n == 1:
        return
    SequenceShards(None, n, 0).check(model.config.n_heads, model.config.n_kv_heads)
    if algorithm is not None and not type(algorithm).sequence_parallel:
        raise ValueError(f"launch.sequence_parallel = {n}: rl.algorithm '{type(algorithm).name}' reads the model's logits "
                         f"outside the sequence-parallel scores; run it with launch.sequence_parallel: 1")


def from_group_first(obj):
    """`obj` as the first rank of this rank's sequence-parallel group has it, on every rank of the
    group (picklable; tensors on the CPU: a pickled GPU tensor would land on the sender's GPU)."""
    lay = layout()
    if lay.sp_size == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=lay.dp_rank * lay.sp_size, group=lay.sp_group)
    return box[0]

