"""Rollout engines behind one interface (docs/architecture.md: Sampler).

Training asks an engine for rollouts; whether they came from our own loop (`native.py`) or from an
external inference engine (`lmdeploy/`, block diffusion) is a config value. Every engine returns
token ids in a `GenerationOutput`, never re-tokenised text, honours one seed per prompt, and
receives the training model's weights before the next rollout (`update_weights`), and is closed when
its user is done (`close`: an external engine's process ends). `sampling/completions.py` is the one
path through an engine.

Each engine is one module (or package) here whose class registers itself with
`@ENGINES.register("<name>")`; importing this package imports every one of them, so a new engine is
its own file, with no list to extend. An external engine's own library is imported only when the
engine is checked or built (its module imports none of it), and runs in its own environment and
process, so DARE's install never needs it.

What an engine can do beyond `RolloutEngine` is declared on its class, read before one is built:
`tree_rollouts` (d-TreeRPO's tree, `sampling/tree.py`: the engine resumes its own denoising loop
from a parent's state) means it has `generate_tree` (`TreeRollouts`). The interfaces are in
`sampling/rollout_engine.py`, beside the rest of the sampler, which never imports this package.
"""
from __future__ import annotations

import importlib
import pkgutil

from dare_core.registry import Registry
from dare_core.sampling.params import SamplingParams
from dare_core.sampling.rollout_engine import RolloutEngine

ENGINES = Registry("rollout engine")


def engine_class(name: str) -> type:
    return ENGINES.lookup(name)


def engines_with(capability: str) -> list[str]:
    """The registered engines that declare `capability` (a class attribute of `RolloutEngine`'s; one
    an engine leaves out it does not have), by name."""
    return sorted(name for name, cls in ENGINES.items() if getattr(cls, capability, False))


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


# after ENGINES exists: each member registers into it as it is imported
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
