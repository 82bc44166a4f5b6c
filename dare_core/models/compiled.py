"""torch.compile made on first use: importing a module that may compile costs nothing, and one
compiled function is shared by every caller of the process (so by every layer of every model whose
layers have one shape: their weights are inputs of the graph, not constants baked into it).

`outside_graphs` keeps a function out of those graphs (`torch.compiler.disable`) without importing
torch._dynamo at import time, which would add about a second to the start of every process (every
stage, every refusal of bad input): the functions are sealed just before the first graph is made."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

_UNSEALED: list[tuple[list, Callable]] = []


def outside_graphs(fn: Callable) -> Callable:
    """`fn`, run eagerly also when called from a function that LazyCompiled compiles (a graph break)."""
    target = [fn]
    _UNSEALED.append((target, fn))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return target[0](*args, **kwargs)

    return call


def _seal() -> None:
    while _UNSEALED:
        target, fn = _UNSEALED.pop()
        target[0] = torch.compiler.disable(fn)


class LazyCompiled:
    def __init__(self, fn: Callable, **options: Any):
        self.fn, self.options = fn, options
        self._compiled: Optional[Callable] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            _seal()
            self._compiled = torch.compile(self.fn, **self.options)
        return self._compiled(*args, **kwargs)
