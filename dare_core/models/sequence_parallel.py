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
from dare_core.models.lm import DiffusionLM, block_causal_mask
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
