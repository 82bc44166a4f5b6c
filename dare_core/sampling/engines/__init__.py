"""Rollout engines behind one interface (ARCHITECTURE.md: sampler vs. engine).

Training asks an engine for rollouts; whether they came from our own loop (`native`) or from an
external inference engine (`lmdeploy`, block diffusion) is a config value. Every engine returns
token ids in a `GenerationOutput`, never re-tokenised text, honours one seed per prompt, and
receives the training model's weights before the next rollout (`update_weights`), and is closed when
its user is done (`close`: an external engine's process ends). External engines are imported lazily
and run in their own environment and process, so DARE's install never needs them. `sampling/completions.py` is the one path
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

    def close(self) -> None: ...


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

    def close(self) -> None:
        pass


def engine_class(name: str) -> type:
    if name not in ENGINES and name in LAZY:
        importlib.import_module(LAZY[name])
    return ENGINES.lookup(name)


def check_engine(name: str, model, params: SamplingParams, record: str = "none", runtime: bool = True) -> None:
    """ValueError for what engine `name` cannot do with `model` (its config is enough: a meta model)
    and `params`, before any weight is read; with `runtime`, RuntimeError where it cannot run on this
    machine. An engine without a `check` takes whatever ours does and runs wherever ours does."""
    cls = engine_class(name)
    if getattr(cls, "check", None) is not None:
        cls.check(model, params, record)
    reason = cls.unavailable() if runtime and getattr(cls, "unavailable", None) is not None else None
    if reason:
        raise RuntimeError(reason)


def build_engine(name: str, model, **options) -> RolloutEngine:
    """`name`'s engine around `model`. Options every engine takes: `model_path`, the checkpoint
    folder `model` was loaded from (an external engine starts from it; ours needs none)."""
    return engine_class(name)(model, **options)
