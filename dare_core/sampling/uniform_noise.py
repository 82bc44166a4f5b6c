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
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class UniformNoiseRule:
    """The step rule's settings (the reference's generation defaults); `of` reads them from the sampler's."""

    entropy_bound: float = 0.1  # accept the lowest-entropy positions while their entropy, less the largest, sums to at most this
    t_min: float = 0.4
    t_max: float = 0.8
    max_steps: int = 48
    stability: int = 1  # steps the argmax canvas must repeat before a block may end (0: no such condition)
    confidence: float = 0.005  # ... and the mean entropy of the tempered logits must be under this

    @classmethod
    def of(cls, params) -> "UniformNoiseRule":
        """From `SamplingParams`: temperature falls from `temperature` to `temperature_min` over each
        block's steps (steps / blocks), `stable_steps` and `stop_entropy` end a block early."""
        t_min = params.temperature if params.temperature_min is None else params.temperature_min
        return cls(entropy_bound=params.entropy_bound, t_min=t_min, t_max=params.temperature, max_steps=params.steps_per_block,
                   stability=params.stable_steps, confidence=params.stop_entropy)

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
                 generators: Sequence[Optional[torch.Generator]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step over canvases [B, C] given their logits [B, C, V]: (next canvas, argmax canvas,
    tempered logits: the next step's self-conditioning input). Each row draws from its own generator
    (None: the global one) in the reference's order, its proposals with one multinomial over its
    positions and then its renoise with one randint, so that a row with the reference's seed
    decodes the reference's tokens, and a row decodes the same in any batch."""
    tempered = logits / rule.temperature(remaining)
    probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)
    b, c, v = probs.shape
    proposal = torch.empty_like(canvas)
    noise = torch.empty_like(canvas)
    for r, g in enumerate(generators):
        proposal[r] = torch.multinomial(probs[r], 1, generator=g).view(c)
        noise[r] = random_canvas(1, c, v, g, canvas.device)[0]
    accepted = entropy_bound_accept(tempered, rule.entropy_bound)
    return torch.where(accepted, proposal, noise), tempered.argmax(-1), tempered


class UniformNoiseBlock:
    """The decoding loop's state of one block under uniform noise (sampling/decode.py): the rows'
    self-conditioning logits, which rows have stopped, and the argmax canvas each will commit."""

    def __init__(self, rule: UniformNoiseRule, vocab_size: int, logits_dtype: torch.dtype):
        self.rule, self.vocab_size, self.logits_dtype = rule, vocab_size, logits_dtype
        self.stop = StableAndConfident(rule.stability, rule.confidence)
        self.previous: Optional[torch.Tensor] = None  # [B, C, V]; None before a block's first step
        self.stopped: Optional[torch.Tensor] = None  # [B]
        self.argmax: Optional[torch.Tensor] = None  # [B, C]

    def start(self, rows: int, length: int, generators: Sequence[Optional[torch.Generator]], device) -> torch.Tensor:
        """A new block: its first canvas [rows, length], each row's drawn from its generator."""
        self.stop.reset()
        self.previous = None
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        self.argmax = torch.cat([random_canvas(1, length, self.vocab_size, g, device) for g in generators])
        return self.argmax.clone()

    def busy(self, j: int) -> torch.Tensor:
        """[B] rows that take step j (none once the block has had its max_steps)."""
        return ~self.stopped & (j < self.rule.max_steps)

    def step(self, canvas: torch.Tensor, logits: torch.Tensor, j: int, rows: torch.Tensor,
             generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
        """Step j of the block for `rows` (their logits [len(rows), C, V]); the next canvas [B, C].
        The other rows keep their canvas, argmax and self-conditioning logits, as the reference
        keeps a batch's stopped rows."""
        nxt, argmax, tempered = denoise_step(canvas[rows], logits, self.rule.max_steps - j, self.rule, generators)
        canvas, self.argmax = canvas.clone(), self.argmax.clone()
        canvas[rows], self.argmax[rows] = nxt, argmax
        tempered = tempered.to(self.logits_dtype)  # (the reference keeps them in the embeddings' dtype)
        if self.previous is None:
            self.previous = torch.zeros((canvas.shape[0], *tempered.shape[1:]), dtype=tempered.dtype, device=tempered.device)
        self.previous[rows] = tempered
        stopped = self.stopped.clone()
        stopped[rows] = self.stop(self.argmax, self.previous)[rows]
        self.stopped |= stopped
        return canvas

    def select(self, keep: torch.Tensor) -> None:
        self.stopped, self.argmax = self.stopped[keep], self.argmax[keep]
        if self.previous is not None:
            self.previous = self.previous[keep]
        if self.stop.history is not None:
            self.stop.history = self.stop.history[:, keep]
