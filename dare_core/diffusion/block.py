"""Block-diffusion two-stream layout [x_t ; x_0] (ALGORITHMS.md 2.8).

The noisy stream z and the clean stream y0 are concatenated (length 2S) and share position ids
0..S-1; with b(i) = position // block_size:
  noisy -> noisy  iff b(q) == b(k)    (bidirectional inside a block)
  noisy -> clean  iff b(k) <  b(q)    (strictly earlier clean blocks)
  clean -> clean  iff b(k) <= b(q)    (block-causal)
  clean -> noisy  never
so every noisy block is denoised given only the clean prefix, all blocks in one forward pass.
"""
from __future__ import annotations

from typing import Optional

import torch

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


def two_stream_hidden(model, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Hidden states of the noisy stream [B, S, d] under the two-stream mask."""
    pos = default_position_ids(noisy_ids, attention_mask)
    mask = two_stream_mask(pos, model.block_size, attention_mask)
    ids = torch.cat([noisy_ids, clean_ids], dim=1)
    hidden = model.net.hidden_states(ids, None, pos.repeat(1, 2), mask)
    return hidden[:, : noisy_ids.shape[1]]
