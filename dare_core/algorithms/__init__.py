"""Objectives: SFT, preference optimisation and the RL algorithms, one module each, registered by
name in the registry of their kind (algorithms/registry.py)."""
from dare_core.algorithms import (  # noqa: F401  (registration)
    bgpo,
    cj_grpo,
    coupled_grpo,
    d1,
    d_tree_rpo,
    ebpo,
    espo,
    just_grpo,
    mdpo,
    preference,
    sft,
    spg,
)
