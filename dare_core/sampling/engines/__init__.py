"""Rollout engines behind one interface (ARCHITECTURE.md: sampler vs. engine).

Training asks an engine for rollouts; whether they came from our own loop (`native`) or from an
external inference engine (`lmdeploy`, block diffusion) is a config value. Every engine returns
token ids in a `GenerationOutput`, never re-tokenised text, honours one seed per prompt, and
receives the training model's weights before the next rollout (`update_weights`). External engines
are imported lazily, so CPU installs never need them. `sampling/completions.py` is the one path
through an engine; tree rollouts (d-TreeRPO) are a capability of the engines that can resume their
own denoising loop (`generate_tree`, the native one).
"""
from __future__ import annotations

import importlib
from typing import Optional, Protocol, Sequence

import torch

from dare_core.registry import Registry
from dare_core.sampling.decode import GenerationOutput, generate
from dare_core.sampling.params import SamplingParams
from dare_core.sampling.tree import TreeOutput, TreeShape, tree_rollout

ENGINES = Registry("rollout engine")
# engines living in optional modules: name -> module that registers it when imported
LAZY = {"lmdeploy": "dare_core.sampling.engines.lmdeploy"}


class RolloutEngine(Protocol):
    name: str
    model: torch.nn.Module  # the training model whose weights the engine decodes with

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generators: Optional[Sequence[torch.Generator]] = None, record: str = "none") -> GenerationOutput: ...

    def update_weights(self, model) -> None: ...


@ENGINES.register("native")
class NativeEngine:
    """Our own denoising loop on the training model itself (weights are always current)."""

    name = "native"

    def __init__(self, model, **_: object):
        self.model = model

    def generate(self, prompts, params, generators=None, record="none") -> GenerationOutput:
        return generate(self.model, prompts, params, generators=generators, record=record)

    def generate_tree(self, prompts: Sequence[Sequence[int]], params: SamplingParams, shape: TreeShape, seed_base: tuple,
                      uids: Sequence[str], batch_size: int) -> TreeOutput:
        """Tree rollouts (`sampling/tree.py`): the model decodes in eval mode and is left in the
        train/eval mode it came in."""
        was_training = self.model.training
        self.model.eval()
        try:
            return tree_rollout(self.model, prompts, params, shape, seed_base, uids, batch_size)
        finally:
            self.model.train(was_training)

    def update_weights(self, model) -> None:
        self.model = model


def build_engine(name: str, model, **options) -> RolloutEngine:
    if name not in ENGINES and name in LAZY:
        importlib.import_module(LAZY[name])
    return ENGINES.lookup(name)(model, **options)
