"""CUDA-graph replay of the cached forwards of fixed width (one block, or the whole canvas at a refresh).

With a dual or block-KV cache a denoising step encodes only the current block (32 tokens, say)
against the cache. At batch 1 that forward is bound by kernel launches, not by the GPU: an 8B model
issues a few hundred small kernels per forward. Capturing the forward once per (batch, width) and
replaying it removes the launch cost; the block's offset is a device tensor (`cols`), so one graph
serves every block. Keys are always the whole canvas: the mask already hides what a block may not
see (later blocks in block diffusion), so the graph needs no per-block key length.
"""
from __future__ import annotations

import gc

import torch

from dare_core.models.transformer import KVCache


class GraphedWindow:
    def __init__(self, model, compile_forward: bool = False):
        self.model = model
        self.shift = 1 if model.family.shift_logits else 0
        self.graphs: dict = {}
        self.pool = None
        # torch.compile fuses the many small kernels of a layer (norms, RoPE, SwiGLU gating), which
        # inside a graph still cost a few microseconds each (`compiled_window_layer`)
        self.compiled = compile_forward

    def reset(self) -> None:
        """Forget captured graphs (the batch or the cache tensors changed). Their memory pool goes
        with them: capturing into a pool whose graphs were all freed is not allowed."""
        self.graphs.clear()
        self.pool = None

    def fn(self, ids, cols, attn, pos, cache):
        return self.model.window_hidden(ids, cols, attn, pos, cache.length, cache, compiled=self.compiled)

    def _capture(self, ids, start, attn, pos, cache):
        ids_buf = ids.clone()
        cols_buf = torch.arange(start, start + ids.shape[1], device=ids.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, lazy kernel init)
            for _ in range(2):
                self.fn(ids_buf, cols_buf, attn, pos, cache)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(ids_buf, cols_buf, attn, pos, cache)
        return graph, ids_buf, cols_buf, out

    def __call__(self, ids: torch.Tensor, start: int, attn: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """Hidden states of the window of `ids` starting at column `start`."""
        key = tuple(ids.shape)
        if key not in self.graphs:
            self.graphs[key] = self._capture(ids, start, attn, pos, cache)
        graph, ids_buf, cols_buf, out = self.graphs[key]
        ids_buf.copy_(ids)
        torch.arange(start, start + ids.shape[1], device=ids.device, out=cols_buf)
        graph.replay()
        return out  # overwritten by the next replay: callers consume it first


class GraphStore:
    """The static buffers captured graphs point at (KV cache, the canvas's key mask and positions)
    for one (batch, canvas length). It stays on the model between `generate` calls, so rollouts of
    the same shape replay the graphs an earlier one captured; the loop pads prompts to a bucket of
    canvas lengths for that reason."""

    def __init__(self, model, batch: int, length: int, compile_forward: bool):
        p = next(model.parameters())
        self.key = store_key(model, batch, length, compile_forward)
        self.cache = KVCache(model.config, batch, length, p.dtype, p.device)
        self.attn = torch.zeros((batch, length), dtype=torch.long, device=p.device)
        self.pos = torch.zeros_like(self.attn)
        self.graphed = GraphedWindow(model, compile_forward)
        self.weights = tuple(q.data_ptr() for q in model.parameters())


def store_key(model, batch: int, length: int, compile_forward: bool) -> tuple:
    # a graph captured with the LoRA adapters folded into the weights (`adapters_merged`) runs no
    # adapter kernels, one captured without them does: the same weight pointers, different graphs
    return batch, length, compile_forward, bool(getattr(model, "_dare_lora_merged", False))


def graph_store(model, batch: int, length: int, compile_forward: bool) -> GraphStore:
    """The model's store for this shape; one at a time (a KV cache per shape would not fit)."""
    # the graphs read the weights where they were at capture: weights gathered anew (ZeRO-3's whole
    # rollout weights, each step) live elsewhere, and the graphs must be captured again
    weights = tuple(q.data_ptr() for q in model.parameters())
    store = getattr(model, "_dare_graph_store", None)
    if store is None or store.key != store_key(model, batch, length, compile_forward) or store.weights != weights:
        model._dare_graph_store = None
        torch.cuda.empty_cache()
        store = GraphStore(model, batch, length, compile_forward)
        model._dare_graph_store = store
    return store


def release_graph_store(model) -> None:
    """Free the model's captured graphs and their static KV cache (the next `generate` under CUDA
    graphs captures anew): memory a caller needs back, e.g. a benchmark's next shape or model."""
    if getattr(model, "_dare_graph_store", None) is not None:
        model._dare_graph_store = None
        gc.collect()  # the store's graphs refer back to the model: a cycle that refcounting leaves
        torch.cuda.empty_cache()
