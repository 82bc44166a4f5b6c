"""What one denoising step decides, given the logits of the current block: the proposal x̂ (6.1 step 2),
each position's confidence (6.1, 6.2), and which masked positions to commit (6.1-6.4).

Unmaskers are registered by name (`SamplingParams.unmasking`). Every one of them only ever selects
masked positions of the current block, and the threshold-like ones always select at least one, so
the loop cannot stall.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dare_core.models.compiled import LazyCompiled
from dare_core.registry import Registry
from dare_core.sampling.params import SamplingParams

UNMASKERS = Registry("unmasking")
DREAM_EPS = 1e-3


def filtered_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits / T (T = 0: unscaled), then top-k, then top-p (nucleus) filtering; removed tokens are -inf."""
    out = logits / temperature if temperature > 0 else logits
    if top_k and top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already reaches p
        out = out.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))
    return out


def _perturbed_argmax(logits: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    """argmax(l + T g) with g = -log(-log u), all in float64, over the last dimension."""
    return (logits.double() - temperature * torch.log(-torch.log(u.clamp_min(1e-300)))).argmax(-1)


_fused_perturbed_argmax = LazyCompiled(_perturbed_argmax, dynamic=False)


def _noisy_argmax(logits: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    # eagerly the perturbation takes ~8 passes over a [positions, vocab] float64 tensor (a GPU
    # rollout step at batch 128 moves ~70 GB for it); compiled it is one pass that reads u and the
    # logits and reduces. The same float64 arithmetic either way.
    if not logits.is_cuda:
        return _perturbed_argmax(logits, u, temperature)
    return _fused_perturbed_argmax(logits, u, temperature)


NOISE_GROUP_BYTES = 1 << 30  # float64 noise of the rows reduced in one launch


def gumbel_argmax(logits: torch.Tensor, temperature: float, generators: Optional[Sequence[torch.Generator]]) -> torch.Tensor:
    """argmax(l + T g), g ~ Gumbel drawn in float64 per sample: a draw from softmax(l / T); T = 0 is argmax.

    Each row's noise comes from its own generator (a row's draw never depends on its neighbours),
    but rows are reduced together in groups of at most NOISE_GROUP_BYTES of noise: one launch per
    row gave the GPU one reduction per block position (4 at SDAR's block) and left most of it idle
    (docs/sampling.md#gumbel-groups). The same noise and float64 arithmetic as row by row, so the same tokens."""
    if temperature <= 0:
        return logits.argmax(-1)
    b, n, v = logits.shape
    group = max(1, NOISE_GROUP_BYTES // max(1, n * v * 8))
    out = []
    for start in range(0, b, group):
        gens = generators[start:start + group]
        u = torch.empty((len(gens), n, v), dtype=torch.float64, device=logits.device)
        for row, g in zip(u, gens):
            if g.device == logits.device:
                torch.rand((n, v), generator=g, dtype=torch.float64, device=g.device, out=row)
            else:
                row.copy_(torch.rand((n, v), generator=g, dtype=torch.float64, device=g.device))
        part = logits[start:start + len(gens)].reshape(-1, v)
        out.append(_noisy_argmax(part, u.view(-1, v), temperature).view(len(gens), n))
    return torch.cat(out)


@dataclass
class StepScores:
    proposal: torch.Tensor  # [B, n] x̂
    confidence: torch.Tensor  # [B, n]
    entropy: Optional[torch.Tensor] = None  # [B, n] vocabulary entropy of the sampling distribution


def score_block(logits: torch.Tensor, params: SamplingParams, generators, want_entropy: bool = False) -> StepScores:
    """Proposal and confidence for every position of the block (logits [B, n, V], float32)."""
    filtered = bool(params.top_k) or params.top_p < 1.0
    scaled = filtered_logits(logits, params.temperature, params.top_k, params.top_p) if filtered else None
    # a sample from softmax(l/T) after filtering: argmax(l/T + g) = argmax(l + T g); without filtering
    # the scaled logits (a full copy of the block's [B, n, V]) are not needed for it
    if filtered:
        proposal = gumbel_argmax(scaled, 1.0 if params.temperature > 0 else 0.0, generators)
    else:
        proposal = gumbel_argmax(logits, params.temperature, generators)

    def sampling_probs() -> torch.Tensor:
        return torch.softmax(scaled if scaled is not None else filtered_logits(logits, params.temperature), -1)

    probs = None
    if params.remasking == "low_confidence":  # LLaDA: the untempered, unfiltered softmax
        # p(x̂) = exp(l_x̂ - logsumexp l): one reduction, no [B, n, V] probabilities written
        conf = torch.exp(logits.gather(-1, proposal[..., None]).squeeze(-1) - torch.logsumexp(logits, -1))
    elif params.remasking == "random":
        conf = torch.stack([torch.rand(logits.shape[1], generator=g, device=g.device) for g in generators]).to(logits.device)
    else:
        probs = sampling_probs()
        if params.remasking == "maskgit_plus":
            conf = probs.gather(-1, proposal[..., None]).squeeze(-1)
        elif params.remasking == "topk_margin":
            top2 = probs.topk(2, dim=-1).values
            conf = top2[..., 0] - top2[..., 1]
        else:  # entropy: sum p log p, the negative entropy (higher = more certain)
            conf = (probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    entropy = None
    if want_entropy:
        probs = probs if probs is not None else sampling_probs()
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return StepScores(proposal, conf, entropy)


def scheduled_counts(params: SamplingParams, masked_at_start: torch.Tensor, masked_now: torch.Tensor, j: int) -> torch.Tensor:
    """How many positions a count-based unmasker commits at step j of a block (per row).

    linear: LLaDA's even split k_j = floor(m/s) + [j < m mod s] of the m masks at the block's start.
    dream: floor(m_now * (1 - s/t)) between timesteps t > s of linspace(1, eps, steps+1); all at the last step."""
    s = params.steps_per_block
    if j >= s:  # only reached by a rule that under-commits: never leave a block unfinished
        return masked_now
    if params.schedule == "linear":
        return masked_at_start // s + (j < masked_at_start % s).long()
    if j == s - 1:
        return masked_now
    t = 1 - (1 - DREAM_EPS) * j / s
    t_next = 1 - (1 - DREAM_EPS) * (j + 1) / s
    return (masked_now.double() * (1 - t_next / t)).floor().long()


def rank_select(score: torch.Tensor, is_masked: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The k highest-scoring masked positions of each row (k clamped to the number masked)."""
    score = score.masked_fill(~is_masked, float("-inf"))
    k = torch.minimum(k, is_masked.sum(-1))
    order = score.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(score.shape[1], device=score.device).expand_as(order))
    return (rank < k[:, None]) & is_masked


def at_least_top1(chosen: torch.Tensor, conf: torch.Tensor, is_masked: torch.Tensor) -> torch.Tensor:
    """Add each row's most confident masked position where a rule chose none (rows with masks only)."""
    top1 = rank_select(conf, is_masked, torch.ones(conf.shape[0], dtype=torch.long, device=conf.device))
    return chosen | (top1 & ~chosen.any(-1, keepdim=True))


@dataclass
class StepContext:
    params: SamplingParams
    j: int  # step index inside the block
    masked_at_start: torch.Tensor  # [B] masked positions of the block when it started
    generators: Optional[Sequence[torch.Generator]] = None


class Unmasker:
    needs_entropy = False

    def select(self, scores: StepScores, is_masked: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError


@UNMASKERS.register("topk")
class TopKUnmasker(Unmasker):
    """The k_j most confident masked positions (LLaDA low-confidence remasking; SDAR `static`;
    Dream's maskgit_plus / topk_margin / entropy with its schedule). With alg_temp > 0 the k_j
    positions are drawn without replacement from softmax(confidence / alg_temp)."""

    def select(self, scores, is_masked, ctx):
        k = scheduled_counts(ctx.params, ctx.masked_at_start, is_masked.sum(-1), ctx.j)
        if ctx.params.alg_temp > 0:
            return _multinomial_positions(scores.confidence, is_masked, k, ctx.params.alg_temp, ctx.generators)
        return rank_select(scores.confidence, is_masked, k)


def _multinomial_positions(conf, is_masked, k, alg_temp, generators):
    out = torch.zeros_like(is_masked)
    logits = (conf / alg_temp).masked_fill(~is_masked, float("-inf"))
    for i, g in enumerate(generators):
        n = int(min(k[i], is_masked[i].sum()))
        if n:
            idx = torch.multinomial(logits[i].double().softmax(-1).to(g.device), n, replacement=False, generator=g)
            out[i, idx.to(out.device)] = True
    return out


@UNMASKERS.register("threshold")
class ThresholdUnmasker(Unmasker):
    """Fast-dLLM: every masked position with confidence >= threshold, and always the top-1."""

    def select(self, scores, is_masked, ctx):
        chosen = (scores.confidence >= ctx.params.threshold) & is_masked
        return at_least_top1(chosen, scores.confidence, is_masked)


@UNMASKERS.register("dynamic")
class DynamicUnmasker(Unmasker):
    """SDAR: all masked positions above the threshold if there are at least k_j of them, else the top k_j."""

    def select(self, scores, is_masked, ctx):
        k = scheduled_counts(ctx.params, ctx.masked_at_start, is_masked.sum(-1), ctx.j)
        above = (scores.confidence > ctx.params.threshold) & is_masked
        enough = above.sum(-1) >= torch.minimum(k, is_masked.sum(-1))
        return torch.where(enough[:, None], above, rank_select(scores.confidence, is_masked, k))


@UNMASKERS.register("factor")
class FactorUnmasker(Unmasker):
    """Fast-dLLM's factor rule: with c_(1) >= c_(2) >= ..., the largest n >= 1 such that
    (n+1)(1 - c_(m)) < f for every m <= n. The left side grows with m, so checking m = n suffices."""

    def select(self, scores, is_masked, ctx):
        conf = scores.confidence.masked_fill(~is_masked, float("-inf"))
        sorted_conf = conf.sort(dim=-1, descending=True).values
        n = torch.arange(1, conf.shape[1] + 1, device=conf.device)
        ok = ((n + 1) * (1 - sorted_conf) < ctx.params.factor) & (sorted_conf > float("-inf"))
        count = ok.long().cumprod(-1).sum(-1).clamp_min(1)
        return rank_select(conf, is_masked, count)


@UNMASKERS.register("entropy_bounded")
class EntropyBoundedUnmasker(Unmasker):
    """Masked positions in ascending vocabulary entropy while the running sum stays <= the bound (>= 1)."""

    needs_entropy = True

    def select(self, scores, is_masked, ctx):
        h = scores.entropy.masked_fill(~is_masked, float("inf"))
        sorted_h = h.sort(dim=-1, stable=True).values
        count = ((sorted_h.cumsum(-1) <= ctx.params.entropy_bound) & sorted_h.isfinite()).sum(-1).clamp_min(1)
        return rank_select(-scores.entropy, is_masked, count)


@UNMASKERS.register("sequential")
class SequentialUnmasker(Unmasker):
    """SDAR: the first k_j masked positions, left to right."""

    def select(self, scores, is_masked, ctx):
        k = scheduled_counts(ctx.params, ctx.masked_at_start, is_masked.sum(-1), ctx.j)
        leftmost = -torch.arange(is_masked.shape[1], device=is_masked.device, dtype=torch.float32).expand(is_masked.shape)
        return rank_select(leftmost, is_masked, k)


@UNMASKERS.register("origin")
class OriginUnmasker(Unmasker):
    """Dream's `origin`: each masked position is revealed independently with probability 1 - s/t."""

    def select(self, scores, is_masked, ctx):
        s = ctx.params.steps_per_block
        if ctx.j >= s - 1:
            return is_masked.clone()
        t = 1 - (1 - DREAM_EPS) * ctx.j / s
        t_next = 1 - (1 - DREAM_EPS) * (ctx.j + 1) / s
        u = torch.stack([torch.rand(is_masked.shape[1], generator=g, device=g.device) for g in ctx.generators]).to(is_masked.device)
        return (u < 1 - t_next / t) & is_masked


def build_unmasker(params: SamplingParams) -> Unmasker:
    return UNMASKERS.lookup(params.unmasking)()
