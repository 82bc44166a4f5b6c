"""torch.compile made on first use: importing a module that may compile costs nothing, and one
compiled function is shared by every caller of the process (so by every layer of every model whose
layers have one shape: their weights are inputs of the graph, not constants baked into it)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class LazyCompiled:
    def __init__(self, fn: Callable, **options: Any):
        self.fn, self.options = fn, options
        self._compiled: Optional[Callable] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, **self.options)
        return self._compiled(*args, **kwargs)
