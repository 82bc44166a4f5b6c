"""A model forward over one rank's slice of every sequence (Ulysses sequence parallelism).

Every rank of a sequence-parallel group is given the same full-length batch (token ids are small)
and runs the layers on its slice of it only: embeddings, norms, MLPs and the output projection per
token, attention on the whole sequence of its share of the heads (models/ulysses.py). The mask is
built once for the whole sequence, as a one-rank forward builds it, and the RoPE positions are the
slice's own positions in the whole sequence, so each rank's hidden states are exactly that slice of
the one-rank forward's.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from dare_core.models.attention import AttentionContext, key_padding_mask
from dare_core.models.lm import DiffusionLM, ScoredStream, block_causal_mask
from dare_core.models.transformer import default_position_ids
from dare_core.models.ulysses import SequenceShards


def shard_hidden_states(
    model: DiffusionLM,
    input_ids: torch.Tensor,
    shards: SequenceShards,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    attn_mask: Union[torch.Tensor, AttentionContext, None] = None,
) -> torch.Tensor:
    """This rank's slice [B, S/N, d] of `model.hidden_states` over the full-length [B, S] batch.

    The arguments are those of `DiffusionLM.hidden_states`, all for the whole sequence: without
    `attn_mask` the family's pattern (bidirectional with key padding, or block-causal) is built from
    `attention_mask`; a caller with its own layout (the two-stream [x_t ; x_0], a packed row) passes
    its boolean mask or AttentionContext and the positions of every token."""
    cfg = model.config
    shards.check(cfg.n_heads, cfg.n_kv_heads, input_ids.shape[1])
    if position_ids is None:
        position_ids = default_position_ids(input_ids, attention_mask)
    if attn_mask is None:
        if model.block_size is not None:
            attn_mask = block_causal_mask(position_ids, model.block_size, attention_mask)
        elif attention_mask is not None:
            attn_mask = key_padding_mask(attention_mask)
    ctx = attn_mask if isinstance(attn_mask, AttentionContext) else AttentionContext(mask=attn_mask)
    ctx = dataclasses.replace(ctx, sequence_parallel=shards)
    return model.net.hidden_states(shards.local(input_ids), None, shards.local(position_ids), ctx)


def pad_for_shards(input_ids: torch.Tensor, clean_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
                   size: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch (noisy ids, clean ids, attention mask, scored rows) grown so that the stream its
    scoring forward runs splits into `size` equal slices, nothing real changed: a padded batch
    gets columns of padding on the right (masked keys, never scored); a packed one, whose stream is
    its real tokens, gets an extra row of (-T mod size) real tokens, a document of its own that no
    other attends to and nothing scores. The scores of the grown batch, cut back to the first B
    rows and S columns, are those of the batch."""
    b, s = input_ids.shape
    extra_rows, width = 0, s
    if packed:
        extra = -int(attention_mask.bool().sum()) % size
        extra_rows, width = (1, max(s, extra)) if extra else (0, s)
    else:
        width = s + (-s % size)

    def grow(x: torch.Tensor, fill) -> torch.Tensor:
        out = x.new_full((b + extra_rows, width), fill)
        out[:b, :s] = x
        return out

    mask = grow(attention_mask, 0)
    if extra_rows:
        mask[b, :extra] = 1
    return grow(input_ids, 0), grow(clean_ids, 0), mask, grow(rows, False)


def shard_stream_hidden(model: DiffusionLM, stream: ScoredStream, shards: SequenceShards) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of `model.stream_hidden(stream)`: the forward runs this rank's slice of the
    stream (the mask and positions of the whole), and of the scored positions this rank keeps
    those whose source hidden state is in its slice (a shifted family's source is the column
    before: a scored position past a slice's edge belongs to the rank holding its source). Returns
    (the hidden states [M, d] of the kept positions, in order; the boolean [N] of those kept): every
    scored position is kept by exactly one rank of the group."""
    r, t = stream.ids.shape
    cfg = model.config
    shards.check(cfg.n_heads, cfg.n_kv_heads, t)
    ctx = stream.attn if isinstance(stream.attn, AttentionContext) else AttentionContext(mask=stream.attn)
    ctx = dataclasses.replace(ctx, sequence_parallel=shards)
    local = model.net.hidden_states(shards.local(stream.ids), None, shards.local(stream.positions), ctx)
    width = t // shards.size
    row, col = stream.sources // t, stream.sources % t - shards.rank * width
    kept = (col >= 0) & (col < width)
    return local[row[kept], col[kept]], kept
