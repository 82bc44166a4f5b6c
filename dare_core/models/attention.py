"""Attention backends behind one call.

  sdpa    PyTorch scaled_dot_product_attention with a dense boolean mask (CPU and GPU; the reference)
  flex    FlexAttention with a sparse BlockMask (block-diffusion patterns, packing); GPU, compiled
  varlen  packed variable-length sequences without padding: flash-attn's varlen kernel when
          installed, else PyTorch's varlen_attn (CUDA only); bidirectional attention only

An `AttentionContext` is built once per forward from the attention pattern (padding, packing,
block-causal) and handed to every layer, so masks are never rebuilt per layer. Its masks always
describe the whole sequence: under sequence parallelism (`sequence_parallel`, models/ulysses.py)
`attend` receives this rank's slice of the sequence for all heads, trades it for the whole sequence
of its share of the heads, runs the backend there and trades back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from dare_core.models.compiled import outside_graphs
from dare_core.models.ulysses import SequenceShards, heads_to_sequence, sequence_to_heads

BACKENDS = ("sdpa", "flex", "varlen")


def key_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] 0/1 key mask -> boolean [B, 1, 1, S] (True = may be attended)."""
    return attention_mask.bool()[:, None, None, :]


@dataclass
class AttentionContext:
    backend: str = "sdpa"
    mask: Optional[torch.Tensor] = None  # sdpa: bool, broadcastable to [B, H, Sq, Sk]
    block_mask: object = None  # flex: torch.nn.attention.flex_attention.BlockMask
    cu_seqlens: Optional[torch.Tensor] = None  # varlen: int32 [n_seqs + 1]
    max_seqlen: int = 0
    sequence_parallel: Optional[SequenceShards] = None  # q/k/v hold this rank's slice of the sequence


FLEX_BLOCK = 128  # FlexAttention's sparse block (rows and columns)
MASK_CHUNK_ELEMENTS = 1 << 26  # query rows x keys evaluated at a time by sparse_block_mask


def sparse_block_mask(allowed, n: int, device, chunk_elements: int = MASK_CHUNK_ELEMENTS):
    """FlexAttention's BlockMask of `allowed(q, k)` (broadcasting index tensors -> bool) over n x n,
    evaluated a chunk of query rows at a time. create_block_mask evaluates the whole n x n grid at
    once, with int64 intermediates (8 bytes a pair: 72 GiB at n = 98,304, SDAR's two streams of a
    49k-token sequence); here memory is O(chunk x n) plus the [n/128, n/128] block table."""
    from torch.nn.attention.flex_attention import BlockMask

    blocks = -(-n // FLEX_BLOCK)
    rows = max(FLEX_BLOCK, chunk_elements // max(blocks * FLEX_BLOCK, 1) // FLEX_BLOCK * FLEX_BLOCK)
    keys = torch.arange(blocks * FLEX_BLOCK, device=device)
    key_real = keys < n
    partial, full = [], []
    for start in range(0, blocks * FLEX_BLOCK, rows):
        q = torch.arange(start, min(start + rows, blocks * FLEX_BLOCK), device=device)
        # padding rows and columns (past n) are masked out, as create_block_mask pads them
        dense = allowed(q.clamp(max=n - 1)[:, None], keys.clamp(max=n - 1)[None, :]) & key_real[None, :] & (q < n)[:, None]
        count = dense.view(len(q) // FLEX_BLOCK, FLEX_BLOCK, blocks, FLEX_BLOCK).sum((1, 3), dtype=torch.int32)
        full.append(count == FLEX_BLOCK * FLEX_BLOCK)
        partial.append((count > 0) & ~full[-1])

    def ordered(flags: list[torch.Tensor]):
        flags = torch.cat(flags)[None, None]
        return (flags.sum(-1, dtype=torch.int32),
                torch.argsort(flags.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32))

    (num, idx), (full_num, full_idx) = ordered(partial), ordered(full)
    return BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=lambda b, h, q, k: allowed(q, k), seq_lengths=(n, n))


def packed_context(seq_lens: list[int], backend: str, device, block_size: Optional[int] = None,
                   position_ids: Optional[torch.Tensor] = None) -> AttentionContext:
    """Context for sequences packed back to back in one row: no token attends across sequences;
    block_size adds block-causal attention inside each sequence (block diffusion)."""
    lens = torch.tensor(seq_lens, device=device)
    doc = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)
    if position_ids is None:
        starts = torch.cumsum(lens, 0) - lens
        position_ids = torch.arange(int(lens.sum()), device=device) - torch.repeat_interleave(starts, lens)
    if backend == "varlen":
        if block_size is not None:
            raise ValueError("varlen attention is bidirectional only; use flex or sdpa for block diffusion")
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lens, 0)
        return AttentionContext("varlen", cu_seqlens=cu, max_seqlen=int(lens.max()))
    blk = position_ids // block_size if block_size is not None else None
    if backend == "flex":
        def allowed(q, k):
            same = doc[q] == doc[k]
            return same & (blk[k] <= blk[q]) if blk is not None else same

        return AttentionContext("flex", block_mask=sparse_block_mask(allowed, int(lens.sum()), device))
    mask = doc[:, None] == doc[None, :]
    if blk is not None:
        mask = mask & (blk[None, :] <= blk[:, None])
    return AttentionContext("sdpa", mask=mask[None, None])



_compiled_flex = None


# Under `model.compile` a training layer is traced by torch.compile; the attention kernels stay out of
# that graph (a graph break) and run as they do eagerly: opaque kernels with their own autograd,
# nothing around them to fuse.
@outside_graphs
def _flex(q, k, v, block_mask):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:
        if _compiled_flex is None:
            # shapes change with every packed batch: let compile mark them dynamic rather than recompile per
            # shape (and fall back to eager, which materialises the whole score matrix, past its limit)
            _compiled_flex = torch.compile(flex_attention)
        # training pins the Triton kernel: AUTO picks the decode kernel for short grouped-query
        # sequences (under 128 tokens), which has no backward (the lowering fails)
        options = {"BACKEND": "TRITON"} if torch.is_grad_enabled() and q.requires_grad else None
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


@outside_graphs
def _varlen(q, k, v, ctx: AttentionContext):
    """q/k/v [1, H, T, D] of packed sequences."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [T, H, D]
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    try:
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(q, k, v, ctx.cu_seqlens, ctx.cu_seqlens, ctx.max_seqlen, ctx.max_seqlen, causal=False)
    except ImportError:
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(q, k, v, ctx.cu_seqlens, ctx.cu_seqlens, ctx.max_seqlen, ctx.max_seqlen)  # full attention
    return out.transpose(0, 1)[None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> torch.Tensor:
    """q: [B, H, Sq, D], k/v: [B, Hkv, Sk, D] -> [B, H, Sq, D]. `ctx` is an AttentionContext, or
    (sdpa shorthand) a boolean mask / None. Under `ctx.sequence_parallel` Sq = Sk = this rank's slice of
    the sequence, and the masks are those of the whole sequence."""
    if not isinstance(ctx, AttentionContext):
        ctx = AttentionContext(mask=ctx)
    shards = ctx.sequence_parallel
    if shards is None:
        return _attend_whole(q, k, v, ctx)
    q, k, v = (sequence_to_heads(t, shards) for t in (q, k, v))
    return heads_to_sequence(_attend_whole(q, k, v, ctx), shards)


def _attend_whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    if ctx.backend == "flex":
        return _flex(q, k, v, ctx.block_mask)
    if ctx.backend == "varlen":
        return _varlen(q, k, v, ctx)
    return _sdpa(q, k, v, ctx.mask)


FOLD_MAX_QUERIES = 64  # windows this short (decoding a block against a cache) fold query groups


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    b, h, sq, d = q.shape
    hkv = k.shape[1]
    foldable = mask is None or (mask.dim() == 4 and mask.shape[1] == 1)
    if h == hkv or sq > FOLD_MAX_QUERIES or not foldable:
        # grouped-query attention without materialising repeated keys (a full KV cache would be copied per layer)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=h != hkv)
    # A few queries per head against a long cache: the kernel's query tiles sit mostly empty, and
    # each query head reads its group's keys again. The heads sharing a key head become extra queries
    # of that head instead (docs/sampling.md#folded-query-groups): the same softmax per query.
    g = h // hkv
    if mask is not None and mask.shape[2] != 1:
        mask = mask[:, :, None].expand(mask.shape[0], 1, g, *mask.shape[2:]).reshape(mask.shape[0], 1, g * sq, mask.shape[3])
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, g * sq, d), k, v, attn_mask=mask, is_causal=False)
    return out.reshape(b, h, sq, d)
