"""Driving an RL algorithm the way the RL loop does, without DeepSpeed: denominators first, then
`update` with a plain autograd backward."""
from typing import Optional

import torch

from dare_core.algorithms.registry import build_options, get_rl_algorithm
from dare_core.config import RLConfig


def make_algo(name: str, model, rl: Optional[RLConfig] = None, **opts):
    cls = get_rl_algorithm(name)
    return cls(build_options(cls, opts, f"rl.algorithm_args.{name}"), rl or RLConfig(), model)


def run_update(algo, model, batch, corruption, old=None, ref=None, denom=None, backward: bool = True):
    """One micro-batch update; returns the LossOutput (gradients accumulated when backward)."""
    if denom is None:
        denom = algo.denominator(batch, corruption)
    elif not isinstance(denom, torch.Tensor):
        denom = torch.tensor([float(denom)], dtype=torch.float64)
    return algo.update(model, batch, corruption, old, ref, denom, (lambda loss: loss.backward()) if backward else (lambda loss: None))
