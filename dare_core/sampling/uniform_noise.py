"""One denoising step of a uniform-noise canvas (DiffusionGemma; docs/families/diffusiongemma.md).

Unlike masked diffusion, no position is ever final inside a block: the canvas starts as uniformly
random tokens, and at each step every position is drawn anew from the tempered logits; the ones the
entropy bound accepts keep their draw, the others are replaced by fresh random tokens. The block
ends when the argmax canvas has been stable for `stability` steps and the mean entropy is under
`confidence` (or after `max_steps`); its committed tokens are the last argmax canvas.

Step n counts down from max_steps to 1, as the reference counts it: the temperature falls linearly
from t_max at the first step to t_min + (t_max - t_min) / max_steps at the last.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class UniformNoiseRule:
    entropy_bound: float = 0.1  # accept the lowest-entropy positions while their entropy, less the largest, sums to at most this
    t_min: float = 0.4
    t_max: float = 0.8
    max_steps: int = 48
    stability: int = 1  # steps the argmax canvas must repeat before a block may end (0: no such condition)
    confidence: float = 0.005  # ... and the mean entropy of the tempered logits must be under this

    def temperature(self, remaining: int) -> float:
        """The temperature at the step with `remaining` steps left (max_steps first, 1 last)."""
        return self.t_min + (self.t_max - self.t_min) * remaining / self.max_steps


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, as torch.distributions computes it (the
    reference's arithmetic: the acceptance compares sums of these with a bound, so ties follow it)."""
    return torch.distributions.Categorical(logits=logits).entropy()


def entropy_bound_accept(logits: torch.Tensor, bound: float) -> torch.Tensor:
    """[B, C] boolean: the k lowest-entropy positions of each row for the largest k whose entropies,
    less the largest of them, sum to at most `bound` (an upper bound on their joint dependence; at
    least one position is always accepted)."""
    entropy = token_entropy(logits)
    sorted_h, order = entropy.sort(dim=-1)
    chosen = sorted_h.cumsum(-1) - sorted_h <= bound
    return torch.zeros_like(chosen).scatter(-1, order, chosen)


class StableAndConfident:
    """Per row: the argmax canvas repeated over the last `stability` steps and the mean entropy of
    the tempered logits under `confidence`. Keeps the history of one block; `reset` between blocks."""

    def __init__(self, stability: int, confidence: float):
        self.stability, self.confidence = stability, confidence
        self.history: Optional[torch.Tensor] = None  # [stability, B, C], -1 before any step

    def reset(self) -> None:
        self.history = None

    def __call__(self, argmax_canvas: torch.Tensor, tempered_logits: torch.Tensor) -> torch.Tensor:
        if self.stability == 0:
            stable = torch.ones(argmax_canvas.shape[0], dtype=torch.bool, device=argmax_canvas.device)
        else:
            if self.history is None:
                self.history = torch.full((self.stability, *argmax_canvas.shape), -1, dtype=argmax_canvas.dtype,
                                          device=argmax_canvas.device)
            stable = (self.history == argmax_canvas[None]).all(-1).all(0)
            self.history = torch.cat([self.history[1:], argmax_canvas[None]])
        return stable & (token_entropy(tempered_logits).mean(-1) < self.confidence)


def random_canvas(rows: int, length: int, vocab_size: int, generator: Optional[torch.Generator], device) -> torch.Tensor:
    """[rows, length] uniformly random tokens: a block's start, and what replaces rejected tokens."""
    return torch.randint(0, vocab_size, (rows, length), generator=generator, device=device)


def denoise_step(canvas: torch.Tensor, logits: torch.Tensor, remaining: int, rule: UniformNoiseRule,
                 generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step over canvases [B, C] given their logits [B, C, V]: (next canvas, argmax canvas,
    tempered logits: the next step's self-conditioning input). Draws the proposals, then the
    renoise, from `generator`, in the reference's order (one multinomial over all B x C positions,
    then one [B, C] randint), so that one row with the reference's seed decodes its tokens."""
    tempered = logits / rule.temperature(remaining)
    probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)
    b, c, v = probs.shape
    proposal = torch.multinomial(probs.view(-1, v), 1, generator=generator).view(b, c)
    accepted = entropy_bound_accept(tempered, rule.entropy_bound)
    kept = torch.where(accepted, proposal, canvas)
    renoised = torch.where(accepted, kept, random_canvas(b, c, v, generator, canvas.device))
    return renoised, tempered.argmax(-1), tempered
