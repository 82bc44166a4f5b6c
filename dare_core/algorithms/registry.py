"""Algorithms by name: `@register("d1")`; the config selects one with `rl.algorithm: d1`."""
from __future__ import annotations

import dataclasses
from typing import Callable

from dare_core.config import from_dict
from dare_core.registry import Registry

ALGORITHMS = Registry("algorithm")


def register(name: str) -> Callable[[type], type]:
    return ALGORITHMS.register(name, set_name=True)


def get_algorithm(name: str) -> type:
    from dare_core.algorithms import d1, sft  # noqa: F401  (register themselves)

    return ALGORITHMS.lookup(name)


def build_options(cls: type, args: dict, where: str):
    """Validate algorithm-specific keys against the algorithm's Options dataclass (unknown key = error)."""
    assert dataclasses.is_dataclass(cls.Options)
    return from_dict(cls.Options, args or {}, where)
