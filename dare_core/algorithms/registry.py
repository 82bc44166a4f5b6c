"""Algorithms by name: `@register("d1")`; the config selects one with `rl.algorithm: d1`."""
from __future__ import annotations

import dataclasses
from typing import Callable

from dare_core.config import from_dict
from dare_core.registry import Registry

# filled as `dare_core.algorithms` (imported before this module, as its package) imports each algorithm
ALGORITHMS = Registry("algorithm")


def register(name: str) -> Callable[[type], type]:
    return ALGORITHMS.register(name, set_name=True)


def get_algorithm(name: str) -> type:
    return ALGORITHMS.lookup(name)


def build_algorithm(rl_cfg, model):
    """The configured RL algorithm for `model`. `rl.algorithm_args` maps algorithm names to their
    options, so switching `rl.algorithm` (e.g. `dvc exp run -S rl.algorithm=spg`) never feeds one
    algorithm's keys to another; every entry is validated, not only the selected one."""
    args = rl_cfg.algorithm_args or {}
    options = None
    for name, opts in args.items():
        cls = get_algorithm(name)
        built = build_options(cls, opts, f"rl.algorithm_args.{name}")
        if name == rl_cfg.algorithm:
            options = built
    cls = get_algorithm(rl_cfg.algorithm)
    if options is None:
        options = build_options(cls, {}, f"rl.algorithm_args.{rl_cfg.algorithm}")
    return cls(options, rl_cfg, model)


def build_options(cls: type, args: dict, where: str):
    """Validate algorithm-specific keys against the algorithm's Options dataclass (unknown key = error)."""
    assert dataclasses.is_dataclass(cls.Options)
    return from_dict(cls.Options, args or {}, where)
