"""The objectives by name, one registry per kind, since each kind is built from other things:
SFT objectives (`@register_sft`; the SFT stage uses `sft`), preference objectives
(`@register_preference`; `preference.algorithm`) and RL algorithms (`@register_rl`; `rl.algorithm`)."""
from __future__ import annotations

import dataclasses
from typing import Callable

from dare_core.config import from_dict
from dare_core.registry import Registry

# filled as `dare_core.algorithms` (imported before this module, as its package) imports each objective
SFT_OBJECTIVES = Registry("SFT objective")  # built from (options, mask id)
PREFERENCE_OBJECTIVES = Registry("preference algorithm")  # built from (options, model, pad_to)
RL_ALGORITHMS = Registry("algorithm")  # built from (options, rl section, model)
# the SFT objective of each kind of noise (`Family.noise`): masked diffusion's ELBO needs a mask token
SFT_OBJECTIVE_OF_NOISE = {"masked": "sft", "uniform": "uniform_sft"}


def register_sft(name: str) -> Callable[[type], type]:
    return SFT_OBJECTIVES.register(name, set_name=True)


def register_preference(name: str) -> Callable[[type], type]:
    return PREFERENCE_OBJECTIVES.register(name, set_name=True)


def register_rl(name: str) -> Callable[[type], type]:
    return RL_ALGORITHMS.register(name, set_name=True)


def get_sft_objective(name: str) -> type:
    return SFT_OBJECTIVES.lookup(name)


def get_preference(name: str) -> type:
    return PREFERENCE_OBJECTIVES.lookup(name, "preference.algorithm")


def get_rl_algorithm(name: str) -> type:
    return RL_ALGORITHMS.lookup(name)


def build_algorithm(rl_cfg, model):
    """The configured RL algorithm for `model`. `rl.algorithm_args` maps algorithm names to their
    options, so switching `rl.algorithm` (e.g. `dvc exp run -S rl.algorithm=spg`) never feeds one
    algorithm's keys to another; every entry is validated, not only the selected one."""
    args = rl_cfg.algorithm_args or {}
    options = None
    for name, opts in args.items():
        cls = get_rl_algorithm(name)
        built = build_options(cls, opts, f"rl.algorithm_args.{name}")
        if name == rl_cfg.algorithm:
            options = built
    cls = get_rl_algorithm(rl_cfg.algorithm)
    if options is None:
        options = build_options(cls, {}, f"rl.algorithm_args.{rl_cfg.algorithm}")
    return cls(options, rl_cfg, model)


def build_options(cls: type, args: dict, where: str):
    """Validate an objective's own keys against its Options dataclass (unknown key = error)."""
    assert dataclasses.is_dataclass(cls.Options)
    return from_dict(cls.Options, args or {}, where)
