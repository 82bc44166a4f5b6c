"""What a rollout engine is (`RolloutEngine`) and what one with tree rollouts adds (`TreeRollouts`):
the interfaces the sampler's callers decode through (`completions.py`), apart from the engines
themselves (`sampling/engines/`, which import the sampler, never the other way round)."""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from dare_core.sampling.decode import GenerationOutput
from dare_core.sampling.params import SamplingParams
from dare_core.sampling.tree import TreeOutput, TreeShape


class RolloutEngine(Protocol):
    name: str
    model: torch.nn.Module  # the training model whose weights the engine decodes with
    tree_rollouts: bool  # a capability: it is also a `TreeRollouts`
    # it decodes the training model itself (its weights are current without a sync); an engine that
    # keeps its own copy is handed whole weights at each sync (under ZeRO-3 a gather, a collective)
    decodes_policy: bool

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generators: Optional[Sequence[torch.Generator]] = None, record: str = "none") -> GenerationOutput: ...

    def update_weights(self, model) -> None: ...

    def close(self) -> None: ...


class TreeRollouts(RolloutEngine, Protocol):
    """An engine that declares `tree_rollouts = True`."""

    def generate_tree(self, prompts: Sequence[Sequence[int]], params: SamplingParams, shape: TreeShape, seed_base: tuple,
                      uids: Sequence[str], batch_size: int) -> TreeOutput: ...
