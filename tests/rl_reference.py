"""Slow, direct reimplementations of the RL losses' pieces for the algorithm tests: log-probs by
the model's plain forward (block diffusion: one plain forward per block over [clean earlier blocks ;
the noisy block]), the PPO clip by hand, KL estimators by hand. Float64, loops, no shortcuts."""
import math
from typing import Sequence

import torch


def plain_logp(model, noisy: torch.Tensor, targets: torch.Tensor, attn: torch.Tensor, temperature: float = 1.0,
               exclude: Sequence[int] = ()) -> torch.Tensor:
    """[B, S] float64 log softmax(f(noisy)/T)[target] at every position."""
    with torch.no_grad():
        if model.block_size is None:
            logits = model(noisy, attn).double()
        else:
            logits = torch.zeros(*noisy.shape, model.net.lm_head.weight.shape[0], dtype=torch.float64)
            bs = model.block_size
            for r in range(noisy.shape[0]):
                cols = attn[r].bool().nonzero().squeeze(-1)  # the compact sequence: blocks by position
                clean, z = targets[r, cols], noisy[r, cols]
                for lo in range(0, cols.numel(), bs):
                    hi = min(lo + bs, cols.numel())
                    inp = torch.cat([clean[:lo], z[lo:hi]])[None]
                    logits[r, cols[lo:hi]] = model(inp)[0, lo:hi].double()
    logits = logits / temperature
    if len(exclude):
        logits[..., list(exclude)] = -math.inf
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)


def ppo(r: float, a: float, eps_lo: float = 0.2, eps_hi: float = 0.2, dual: float = 3.0) -> float:
    """max(-A r, -A clip(r)), capped at -A c for A < 0."""
    loss = max(-a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi))
    if a < 0 and dual > 0:
        loss = min(loss, -a * dual)
    return loss


def kl(d: float, estimator: str) -> float:
    """KL estimators of delta = s - s_ref."""
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return min(math.exp(-d) + d - 1, 10.0)


def grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])
