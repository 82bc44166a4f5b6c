"""Cache policies: which canvas columns one denoising step re-encodes (docs/sampling.md#fast-dllm-caches, docs/sampling.md#block-diffusion-decoding).

Every policy is expressed as windows over one `KVCache` that spans the whole canvas. A forward
over a window writes that window's keys/values into the cache and attends to the cache's first
`key_end` columns, so:

  none      every step encodes the canvas (masked: all of it; block diffusion: up to the block's end)
  prefix    at a refresh, the whole canvas; otherwise the current block and everything after it,
            reading the prefix before the block from the cache
  dual      at a refresh, the whole canvas; otherwise only the current block, reading the prefix
            and the masked suffix from the cache
  block_kv  block diffusion: prefill the full prompt blocks once (in windows of whole blocks, at
            most `PREFILL_TOKENS` tokens a forward over all rows: a prompt block reads only the
            blocks before it, so the windows' keys and values are the one window's); each step
            encodes the current block against the cache; a finished block gets one more forward of
            its clean tokens, whose keys/values are the ones later blocks read

Refreshes happen at the start of every block and, with `refresh_every = k > 0`, every k steps
inside it (k = 1 reproduces decoding without a cache). A shifted family (Dream) reads column c's
logits from hidden state c-1, so its windows start one column before the block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dare_core.registry import Registry
from dare_core.sampling.params import SamplingParams

CACHE_POLICIES = Registry("cache")
# tokens (over all rows) one prefill forward encodes at most: the forward's activations, not the
# cache, are what a long prompt's prefill adds (32 rows of 16k tokens in one forward ran an 8B model
# out of an H200's memory, bench/results/rollout_context.md), and a window this wide keeps the GPU busy
PREFILL_TOKENS = 65536


@dataclass(frozen=True)
class Window:
    start: int
    end: int
    key_end: int


class CachePolicy:
    uses_kv = True
    block_diffusion: Optional[bool] = None  # True: block families only; False: masked only; None: both

    def __init__(self, params: SamplingParams, shift: int, block_diffusion: bool):
        self.params, self.shift, self.is_block = params, shift, block_diffusion

    def prefill(self, first_block_start: int, rows: int) -> list[Window]:
        """The windows that encode the prompt before the first decoded block (none: no prefill)."""
        return []

    def step(self, j: int, lo: int, hi: int, length: int) -> Window:
        raise NotImplementedError

    def commit(self, lo: int, hi: int) -> Optional[Window]:
        return None

    def refresh_due(self, j: int) -> bool:
        k = self.params.refresh_every
        return j == 0 or (k > 0 and j % k == 0)


@CACHE_POLICIES.register("none")
class NoCache(CachePolicy):
    uses_kv = False

    def step(self, j, lo, hi, length):
        end = hi if self.is_block else length  # nothing after a block can be seen in block diffusion
        return Window(0, end, end)


class FastDLLMCache(CachePolicy):
    """Prefix and dual cache: the whole canvas at a refresh, else a window from the block's start
    that ends at the canvas end (prefix) or at the block's end (dual)."""

    block_diffusion = False
    window_to_block_end = False

    def step(self, j, lo, hi, length):
        if self.refresh_due(j):
            return Window(0, length, length)
        return Window(lo - self.shift, hi if self.window_to_block_end else length, length)


@CACHE_POLICIES.register("prefix")
class PrefixCache(FastDLLMCache):
    pass


@CACHE_POLICIES.register("dual")
class DualCache(FastDLLMCache):
    window_to_block_end = True


@CACHE_POLICIES.register("block_kv")
class BlockKVCache(CachePolicy):
    block_diffusion = True

    def prefill(self, first_block_start, rows):
        block = self.params.block_length
        width = max(block, PREFILL_TOKENS // max(rows, 1) // block * block)
        return [Window(start, min(start + width, first_block_start), min(start + width, first_block_start))
                for start in range(0, first_block_start, width)]

    def step(self, j, lo, hi, length):
        # keys written here come from a partially masked block; the commit forward overwrites them
        return Window(lo, hi, hi)

    def commit(self, lo, hi):
        return Window(lo, hi, hi)


def check_cache_fits(params: SamplingParams, block_diffusion: bool) -> None:
    """Raise ValueError when `params.cache` does not apply to this kind of model (cheap: no model
    needed, so stages check it before they touch anything)."""
    cls = CACHE_POLICIES.lookup(params.cache)
    if cls.block_diffusion is not None and cls.block_diffusion != block_diffusion:
        kind = "block-diffusion" if block_diffusion else "masked-diffusion"
        fits = "none or block_kv" if block_diffusion else "none, prefix or dual"
        raise ValueError(f"cache '{params.cache}' does not apply to a {kind} model; use {fits}")


def build_cache_policy(params: SamplingParams, shift: int, block_diffusion: bool) -> CachePolicy:
    check_cache_fits(params, block_diffusion)
    return CACHE_POLICIES.lookup(params.cache)(params, shift, block_diffusion)
