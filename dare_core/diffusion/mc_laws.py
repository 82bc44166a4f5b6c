"""Multi-row corruption laws of the RL and preference estimators (docs/diffusion.md#corruption-laws, docs/diffusion.md#mask-families, docs/diffusion.md#coupled-passes, docs/diffusion.md#mc-elbo, docs/diffusion.md#per-block-elbo, docs/diffusion.md#blockwise-eubo).

Every law here returns a `CorruptionSet`: R corrupted copies of a batch, each drawn from one
explicit generator per sample (so a sample's masks do not depend on its batch neighbours), with
per-position weights 1/p of the law that drew the position. Only the valid region V of each
response is ever masked and scored; under tail_policy "mask" the tail (after the first EOS) is MASK
in every row and never scored, under "keep" it stays clean context.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from dare_core.diffusion.masking import Corruption, CorruptionSet, masked_corruption
from dare_core.diffusion.uniform import UNIFORM_EPS, uniform_corrupt

TAIL_POLICIES = ("mask", "keep")


def tail_region(valid: torch.Tensor, canvas: torch.Tensor, tail_policy: str) -> torch.Tensor | None:
    """Response positions that every row hides without scoring (the EOS tail under "mask")."""
    if tail_policy not in TAIL_POLICIES:
        raise ValueError(f"tail_policy must be one of {TAIL_POLICIES}, got '{tail_policy}'")
    return (canvas.bool() & ~valid.bool()) if tail_policy == "mask" else None


def stratified_counts(n: int, rows: int, g: torch.Generator, with_zero: bool = False) -> list[int]:
    """Stratified mask counts for one sequence with n maskable positions (1.3):
    law (b) l_j in {1..n}: k ~ U{1..n}, l_j = ((round(k + j n/N) - 1) mod n) + 1;
    law (c) l_j in {0..n} (ESPO): k ~ U{0..n}, l_j = round(k + j (n+1)/N) mod (n+1).
    Each l_j is marginally uniform; together they spread over the range."""
    if with_zero:
        k = int(torch.randint(0, n + 1, (), generator=g))
        return [int(math.floor(k + j * (n + 1) / rows + 0.5)) % (n + 1) for j in range(rows)]
    k = int(torch.randint(1, n + 1, (), generator=g))
    return [((int(math.floor(k + j * n / rows + 0.5)) - 1) % n) + 1 for j in range(rows)]


def _subset(idx: torch.Tensor, count: int, g: torch.Generator) -> torch.Tensor:
    return idx[torch.randperm(idx.numel(), generator=g)[:count]]


def count_rows(input_ids: torch.Tensor, prompt_len: int, valid: torch.Tensor, canvas: torch.Tensor, mask_id: int,
               rows: int, generators: Sequence[torch.Generator], with_zero: bool = False, complement: bool = False,
               tail_policy: str = "mask") -> CorruptionSet:
    """MC-ELBO rows (2.3): stratified counts, one uniform l-subset of V per row, weight n/l (law b)
    or (n+1)/l (law c). `complement` (ESPO's espo_reduce_var) adds, after each row, the row masking
    the rest of V with p^c = (n - l)/(n + 1). The mean over all returned rows estimates the ELBO."""
    B, L = valid.shape
    hide = tail_region(valid, canvas, tail_policy)
    masks = torch.zeros(2 * rows if complement else rows, B, L, dtype=torch.bool)
    weights = torch.zeros(masks.shape, dtype=torch.float32)
    probs = torch.ones(masks.shape[:2])
    denom_extra = 1 if with_zero else 0
    for b, g in enumerate(generators):
        idx = valid[b].nonzero().squeeze(-1).cpu()
        n = idx.numel()
        if n == 0:
            continue
        for j, count in enumerate(stratified_counts(n, rows, g, with_zero)):
            r = 2 * j if complement else j
            chosen = torch.zeros(L, dtype=torch.bool)
            chosen[_subset(idx, count, g)] = True
            masks[r, b] = chosen
            p = count / (n + denom_extra)
            probs[r, b] = p
            if count:
                weights[r, b, chosen] = 1.0 / p
            if complement:
                rest = torch.zeros(L, dtype=torch.bool)
                rest[idx] = True
                rest &= ~chosen
                masks[r + 1, b] = rest
                pc = (n - count) / (n + denom_extra)
                probs[r + 1, b] = pc
                if n - count:
                    weights[r + 1, b, rest] = 1.0 / pc
    dev = input_ids.device
    return CorruptionSet([masked_corruption(input_ids, prompt_len, m.to(dev), mask_id, p, w.to(dev), hide)
                          for m, p, w in zip(masks, probs, weights)])


def coupled_rows(input_ids: torch.Tensor, prompt_len: int, valid: torch.Tensor, canvas: torch.Tensor, mask_id: int,
                 generators: Sequence[torch.Generator], t_min: float = 0.2, t_max: float = 0.8,
                 include_full: bool = True, tail_policy: str = "mask") -> CorruptionSet:
    """Coupled-GRPO's passes (2.2): t ~ U(t_min, t_max), u_i ~ U(0,1); A masks {u_i < t} within V
    (weight 1/t), B its complement within V (weight 1/(1-t)), F (optional) all of V (weight 1).
    info["t"] holds each sample's t."""
    B, L = valid.shape
    hide = tail_region(valid, canvas, tail_policy)
    t = torch.empty(B)
    u = torch.empty(B, L)
    for b, g in enumerate(generators):
        t[b] = t_min + (t_max - t_min) * torch.rand((), generator=g)
        u[b] = torch.rand(L, generator=g)
    dev = input_ids.device
    v = valid.bool().cpu()
    a = (u < t[:, None]) & v
    bb = v & ~a  # the complement inside V, not u > t
    ones = torch.ones(B)
    out = [masked_corruption(input_ids, prompt_len, a.to(dev), mask_id, t, (a / t[:, None]).to(dev), hide),
           masked_corruption(input_ids, prompt_len, bb.to(dev), mask_id, 1 - t, (bb / (1 - t)[:, None]).to(dev), hide)]
    if include_full:
        out.append(masked_corruption(input_ids, prompt_len, v.to(dev), mask_id, ones, v.float().to(dev), hide))
    return CorruptionSet(out, {"t": t})


def response_blocks(attention_mask: torch.Tensor, prompt_len: int, block_size: int, block_origin: str) -> torch.Tensor:
    """[B, L] block index of every response position: `response` counts blocks from the end of the
    prompt (masked-diffusion semi-AR decoding), `global` over the compact prompt + response
    (how SDAR and LLaDA2 decode), so the first response block may be partial."""
    L = attention_mask.shape[1] - prompt_len
    if block_origin == "response":
        return (torch.arange(L, device=attention_mask.device) // block_size).expand(attention_mask.shape[0], L)
    if block_origin != "global":
        raise ValueError(f"block_origin must be 'response' or 'global', got '{block_origin}'")
    pos = attention_mask.long().cumsum(-1) - 1
    return pos[:, prompt_len:].clamp_min(0) // block_size


def per_block_rows(input_ids: torch.Tensor, prompt_len: int, valid: torch.Tensor, canvas: torch.Tensor, mask_id: int,
                   blocks: torch.Tensor, rows: int, generators: Sequence[torch.Generator],
                   tail_policy: str = "mask") -> CorruptionSet:
    """EBPO's per-block composite law (2.4): N rows x C response blocks = N*C cells with stratified
    levels t_idx = (U + idx/(N C)) mod 1; cell (j, b) masks m = min(floor(t |R_b|) + 1, |R_b|)
    uniformly chosen positions of R_b (m uniform on {1..|R_b|}), weight |R_b| / m."""
    B, L = valid.shape
    hide = tail_region(valid, canvas, tail_policy)
    masks = torch.zeros(rows, B, L, dtype=torch.bool)
    weights = torch.zeros(rows, B, L)
    v, blk = valid.bool().cpu(), blocks.cpu()
    for b, g in enumerate(generators):
        ids = blk[b][v[b]].unique()
        cells = rows * len(ids)
        if cells == 0:
            continue
        base = float(torch.rand((), generator=g))
        for j in range(rows):
            for c, block in enumerate(ids.tolist()):
                t = (base + (j * len(ids) + c) / cells) % 1.0
                idx = (v[b] & (blk[b] == block)).nonzero().squeeze(-1)
                size = idx.numel()
                m = min(int(math.floor(t * size)) + 1, size)
                chosen = _subset(idx, m, g)
                masks[j, b, chosen] = True
                weights[j, b, chosen] = size / m
    dev = input_ids.device
    return CorruptionSet([masked_corruption(input_ids, prompt_len, m.to(dev), mask_id, torch.ones(B), w.to(dev), hide)
                          for m, w in zip(masks, weights)])


def blockwise_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, valid: torch.Tensor,
                   mask_id: int, block_size: int, rows: int, generators: Sequence[torch.Generator],
                   p_mask_prompt: float = 0.15) -> CorruptionSet:
    """SPG's block-wise law (2.5). Per row: a block b (distinct across the rows of a sequence where
    possible: a random permutation of the blocks taken modulo the blocks holding valid tokens);
    earlier blocks clean, m ~ U{1..|b ∩ V|} valid positions of b masked, everything after b and
    outside V masked; clean context (prompt and earlier blocks) then masked with p_mask_prompt.
    Scored: the valid positions that are MASK. info["mask_fraction"] [B, R] = |S_j ∩ V| / L_v."""
    B, S = input_ids.shape
    L = S - prompt_len
    v = valid.bool().cpu()
    blk = torch.arange(L) // block_size
    real_prompt = attention_mask[:, :prompt_len].bool().cpu()
    out_noisy = [input_ids.clone() for _ in range(rows)]
    out_scored = [torch.zeros(B, S, dtype=torch.bool) for _ in range(rows)]
    frac = torch.zeros(B, rows)
    for b, g in enumerate(generators):
        vb = v[b]
        n_valid = int(vb.sum())
        if n_valid == 0:
            continue
        n_prompt = int(real_prompt[b].sum())
        with_valid = blk[vb].unique()
        order = torch.randperm(int(blk.max()) + 1, generator=g)
        for j in range(rows):
            block = int(with_valid[int(order[j % len(order)]) % len(with_valid)])
            in_b = (blk == block) & vb
            idx = in_b.nonzero().squeeze(-1)
            m = int(torch.randint(1, idx.numel() + 1, (), generator=g))
            masked = torch.zeros(L, dtype=torch.bool)
            masked[_subset(idx, m, g)] = True
            masked |= (blk > block) | ~vb
            context = torch.cat([real_prompt[b], (blk < block) & vb])
            # one draw per real prompt token and per response position: independent of the padding
            u = torch.rand(n_prompt + L, generator=g) < p_mask_prompt
            noise = torch.zeros(S, dtype=torch.bool)
            noise[:prompt_len][real_prompt[b]] = u[:n_prompt]
            noise[prompt_len:] = u[n_prompt:]
            hit = context & noise
            full = torch.cat([torch.zeros(prompt_len, dtype=torch.bool), masked]) | hit
            out_noisy[j][b] = torch.where(full.to(input_ids.device), torch.full_like(input_ids[b], mask_id), input_ids[b])
            scored = torch.cat([torch.zeros(prompt_len, dtype=torch.bool), (masked | hit[prompt_len:]) & vb])
            out_scored[j][b] = scored
            frac[b, j] = scored.sum() / n_valid
    dev = input_ids.device
    return CorruptionSet([Corruption(nz, sc.to(dev), torch.ones(B)) for nz, sc in zip(out_noisy, out_scored)],
                         {"mask_fraction": frac})


def uniform_time_rows(input_ids: torch.Tensor, prompt_len: int, valid: torch.Tensor, vocab_size: int, rows: int,
                      generators: Sequence[torch.Generator], tail_fill: int, canvas: Optional[torch.Tensor] = None,
                      eps: float = UNIFORM_EPS) -> CorruptionSet:
    """Uniform noise (no mask token; docs/diffusion.md#uniform-noise-elbo): `rows` stratified times
    per sequence, t_r = eps + (1 - 2 eps)(r + u) / R with one offset u ~ U(0, 1) each, and row r the
    response with every token replaced, with probability t_r, by a uniformly random id. The tail
    after the valid region is corrupted as `tail_fill` (EOS: what the rollout layout puts there) would
    be, whatever it holds, so that it never changes a score. Each row's `p` is its time; its valid
    positions are scored (by the uniform ELBO's integrand, not by a log-probability). `canvas`
    [B, L]: each row's response positions (a prefix; default all), the only ones drawn for, so that
    a row's noise does not depend on how wide its batch is (evaluation batches rows of several
    lengths)."""
    offsets = torch.stack([torch.rand((), generator=g) for g in generators])
    response = input_ids[:, prompt_len:].masked_fill(~valid.bool(), tail_fill)
    widths = canvas.sum(-1).tolist() if canvas is not None else [response.shape[1]] * len(generators)
    scored = torch.zeros_like(input_ids, dtype=torch.bool)
    scored[:, prompt_len:] = valid.bool()
    out = []
    for r in range(rows):
        t = eps + (1 - 2 * eps) * (r + offsets) / rows
        noisy = input_ids.clone()
        for b, (g, n) in enumerate(zip(generators, widths)):
            noisy[b, prompt_len:prompt_len + n] = uniform_corrupt(response[b:b + 1, :n], t[b:b + 1], vocab_size, [g])[0]
        out.append(Corruption(noisy, scored, t.to(input_ids.device), prompt_len=prompt_len))
    return CorruptionSet(out)
