"""Objectives: SFT, preference optimisation and the RL algorithms, one module each, registered by
name (`rl.algorithm: <name>`)."""
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
    sft,
    spg,
)
