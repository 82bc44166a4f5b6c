"""The decoding loop's forward for an encoder-decoder family (DiffusionGemma): the counterpart of
`decode.Forward`, over an `EncoderCache` instead of a `KVCache` (docs/families/diffusiongemma.md).

The cache policy's windows keep their meaning: a prefill or commit window (no logits asked for)
encodes clean tokens, the prompt and then each committed block, into the encoder's cache; a step
window decodes the current block's canvas over that cache, conditioned on the previous step's
logits. Without a cache (policy `none`) each step runs the whole prefix as clean tokens and the
block as noisy ones in one pass, which gives the cached logits.
"""
from __future__ import annotations

from typing import Optional

import torch

from dare_core.models.gemma4 import EncoderCache


class EncoderForward:
    def __init__(self, model, canvas, policy, params, block):
        """`block`: the loop's `UniformNoiseBlock`, whose self-conditioning logits each step reads."""
        if params.cfg_scale > 0:
            raise ValueError("classifier-free guidance (cfg_scale > 0) needs a mask token; this family has none")
        self.model, self.canvas, self.policy, self.block = model, canvas, policy, block
        self.cache: Optional[EncoderCache] = EncoderCache(len(model.net.layers)) if policy.uses_kv else None
        self.static = None  # (no CUDA graphs)
        self.nfe = 0
        self.work = {"encoded_tokens": 0, "key_pairs": 0, "logit_tokens": 0}

    def __call__(self, w, lo: Optional[int] = None, hi: Optional[int] = None) -> Optional[torch.Tensor]:
        """Encode window `w` (lo None), or the logits [B, hi-lo, V] of the block [lo, hi)."""
        c, net = self.canvas, self.model.net
        self.nfe += 1
        rows = c.x.shape[0]
        if lo is None:
            cached = self.cache.positions.shape[1] if self.cache.positions is not None else 0
            net.encode(self.cache, c.x[:, w.start:w.end], c.pos[:, w.start:w.end], c.attn[:, w.start:w.end])
            self._count(rows, w.end - w.start, cached + w.end - w.start, 0)
            return None
        previous = self.block.previous  # (the self-conditioning logits: None at a block's first step)
        if self.cache is not None:
            cached = self.cache.positions.shape[1]
            logits = net.decode(self.cache, c.x[:, lo:hi], c.pos[:, lo:hi], previous)
            self._count(rows, hi - lo, cached + hi - lo, hi - lo)
            return logits
        cols = torch.arange(hi, device=c.x.device)
        clean = (cols < lo).expand(rows, hi)
        start = torch.where(clean, 0, c.pos[:, lo:lo + 1])
        hidden = net(c.x[:, :hi], clean, c.pos[:, :hi], start, previous, attention_mask=c.attn[:, :hi])
        self._count(rows, hi, hi, hi - lo)
        return net.logits(hidden[:, lo:hi])

    def _count(self, rows: int, width: int, keys: int, logit_cols: int) -> None:
        self.work["encoded_tokens"] += rows * width
        self.work["key_pairs"] += rows * width * keys
        self.work["logit_tokens"] += rows * logit_cols

    def select(self, keep: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.select(keep)
