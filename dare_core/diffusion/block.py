"""Block-diffusion two-stream layout [x_t ; x_0] (docs/diffusion.md#two-stream).

The noisy stream z and the clean stream y0 are concatenated (length 2S) and share position ids
0..S-1; with b(i) = position // block_size:
  noisy -> noisy  iff b(q) == b(k)    (bidirectional inside a block)
  noisy -> clean  iff b(k) <  b(q)    (strictly earlier clean blocks)
  clean -> clean  iff b(k) <= b(q)    (block-causal)
  clean -> noisy  never
so every noisy block is denoised given only the clean prefix, all blocks in one forward pass.
Packed (`model.packing`), each sequence becomes one document [its noisy tokens ; its clean tokens]
under the same four rules, with no attention across documents.
"""
from __future__ import annotations

from typing import Optional

import torch

from dare_core.models.attention import AttentionContext, sparse_block_mask
from dare_core.models.lm import ScoredStream
from dare_core.models.packing import PackedLayout, packed_backend
from dare_core.models.transformer import default_position_ids


def two_stream_mask(position_ids: torch.Tensor, block_size: int, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, 1, 2S, 2S] boolean mask of the four rules above (padding keys never attended)."""
    blk = position_ids // block_size
    q, k = blk[:, :, None], blk[:, None, :]
    noisy_noisy = q == k
    noisy_clean = k < q
    clean_clean = k <= q
    clean_noisy = torch.zeros_like(noisy_noisy)
    top = torch.cat([noisy_noisy, noisy_clean], dim=2)
    bottom = torch.cat([clean_noisy, clean_clean], dim=2)
    mask = torch.cat([top, bottom], dim=1)
    if attention_mask is not None:
        keys = attention_mask.bool().repeat(1, 2)
        mask = mask & keys[:, None, :]
        # a padding query row would see no key at all (NaN softmax): let it see itself
        eye = torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
        mask = mask | (eye & ~keys[:, :, None])
    return mask[:, None]


def through_stop_block(attention_mask: torch.Tensor, prompt_len: int, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """`attention_mask` [B, P+L] without the response canvas after the block of each row's last
    valid token (`lengths` [B]: valid response tokens, the stop token included). Under the rules
    above no position in or before that block sees a later block, so an objective that scores only
    valid positions reads the same logits without them; packed, they cost nothing."""
    pos = default_position_ids(attention_mask, attention_mask)
    last = pos.gather(1, (prompt_len + lengths.to(pos.device) - 1)[:, None])
    keep = pos // block_size <= last // block_size
    keep[:, :prompt_len] = True
    return attention_mask * keep.to(attention_mask.dtype)


def two_stream_context(doc: torch.Tensor, block: torch.Tensor, clean: torch.Tensor, backend: str) -> AttentionContext:
    """The four rules over a packed stream: per token its document, block index and stream (clean or
    noisy); no token attends across documents."""
    def allowed(q, k):
        same_doc = doc[q] == doc[k]
        noisy_q = (~clean[k] & (block[k] == block[q])) | (clean[k] & (block[k] < block[q]))
        clean_q = clean[k] & (block[k] <= block[q])
        return same_doc & torch.where(clean[q], clean_q, noisy_q)

    if backend == "flex":
        return AttentionContext("flex", block_mask=sparse_block_mask(allowed, doc.numel(), doc.device))
    if backend != "sdpa":
        raise ValueError(f"the two-stream layout needs the flex or sdpa attention backend, not {backend}")
    index = torch.arange(doc.numel(), device=doc.device)
    return AttentionContext("sdpa", mask=allowed(index[:, None], index[None, :])[None, None])


def two_stream_logits(model, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, attention_mask: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] of the noisy stream at the boolean [B, S] `rows` (row-major), padded or packed."""
    return model.net.lm_head(two_stream_scored_hidden(model, noisy_ids, clean_ids, attention_mask, rows))


def two_stream_scored_hidden(model, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, attention_mask: torch.Tensor,
                             rows: torch.Tensor) -> torch.Tensor:
    """Hidden states [N, d] of the noisy stream predicting the boolean [B, S] `rows` (row-major),
    padded or packed: what the output head scores."""
    return model.stream_hidden(two_stream_scored_stream(model, noisy_ids, clean_ids, attention_mask, rows))


def two_stream_scored_stream(model, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, attention_mask: torch.Tensor,
                             rows: torch.Tensor) -> ScoredStream:
    """The `ScoredStream` of `two_stream_scored_hidden`: [x_t ; x_0] per row of the padded batch, or
    under `model.packing` each sequence's [noisy ; clean] packed back to back in one row."""
    backend = packed_backend(model.packing, noisy_ids.device, block_diffusion=True)
    if backend is None:
        pos = default_position_ids(noisy_ids, attention_mask)
        mask = two_stream_mask(pos, model.block_size, attention_mask)
        ids = torch.cat([noisy_ids, clean_ids], dim=1)
        # the noisy stream is the first half of each row of 2S
        return ScoredStream(ids, pos.repeat(1, 2), mask, model.flat_sources(rows, attention_mask, ids.shape[1]))
    layout = PackedLayout.of(attention_mask)
    lens = torch.tensor(layout.lens, device=noisy_ids.device)
    per_token = lambda values: torch.repeat_interleave(values, lens)  # noqa: E731
    # document b holds its n_b noisy tokens, then its n_b clean ones, at slots 2 * start_b + ...
    noisy_slot = 2 * per_token(layout.starts()) + layout.positions
    clean_slot = noisy_slot + per_token(lens)
    total = 2 * layout.total
    ids = noisy_ids.new_empty(total)
    ids[noisy_slot], ids[clean_slot] = noisy_ids[layout.valid], clean_ids[layout.valid]
    pos = layout.positions.new_empty(total)
    pos[noisy_slot] = pos[clean_slot] = layout.positions
    clean = torch.zeros(total, dtype=torch.bool, device=ids.device)
    clean[clean_slot] = True
    doc = torch.repeat_interleave(torch.arange(len(layout.lens), device=ids.device), 2 * lens)
    ctx = two_stream_context(doc, pos // model.block_size, clean, backend)
    return ScoredStream(ids[None], pos[None], ctx, noisy_slot[layout.sources(rows, model.family.shift_logits)])
