"""Attention backends behind one call.

On CPU (and as the reference everywhere) this is PyTorch SDPA with a boolean mask. Masks are built
by the caller from the family's attention pattern; a KV cache (issue: fast rollouts) plugs in here
by extending `k`/`v` before the call.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def key_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] 0/1 key mask -> boolean [B, 1, 1, S] (True = may be attended)."""
    return attention_mask.bool()[:, None, None, :]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q: [B, H, Sq, D], k/v: [B, Hkv, Sk, D]; mask broadcastable to [B, H, Sq, Sk], True = attend."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
