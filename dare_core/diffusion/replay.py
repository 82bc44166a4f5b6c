"""Trajectory corruptions: the exact states a rollout went through (docs/diffusion.md#trajectory-replay, docs/diffusion.md#exact-ar).

Unlike the random laws, these do not draw anything: the rollout's step map says which positions
each denoising step committed, and replaying step k means feeding the model the state before it.
`tail_policy` does not apply; the tail appears exactly as the rollout had it.
"""
from __future__ import annotations

import torch

from dare_core.diffusion.masking import Corruption, CorruptionSet


def replay_rows(input_ids: torch.Tensor, prompt_len: int, step_map: torch.Tensor, scored: torch.Tensor, mask_id: int,
                targets: torch.Tensor | None = None) -> CorruptionSet:
    """One row per step k = 1..K: the state before step k (tokens committed at steps < k, MASK at
    every response position committed at k or later, or never), scoring `scored & step == k`.
    `step_map` [B, L] is 1-based (0 = never decoded); `targets` [B, S] the tokens the rollout
    actually decoded, when the batch's ids differ (e.g. block diffusion's post-EOS latents)."""
    ids = targets if targets is not None else input_ids
    steps = step_map.to(input_ids.device)
    K = int(steps.max()) if steps.numel() else 0
    B = input_ids.shape[0]
    rows = []
    for k in range(1, K + 1):
        known = (steps > 0) & (steps < k)
        resp = torch.where(known, ids[:, prompt_len:], torch.full_like(steps, mask_id, dtype=ids.dtype))
        noisy = torch.cat([ids[:, :prompt_len], resp], dim=1)
        sc = torch.zeros_like(ids, dtype=torch.bool)
        sc[:, prompt_len:] = (steps == k) & scored.bool()
        rows.append(Corruption(noisy, sc, torch.ones(B), None, targets))
    return CorruptionSet(rows)


def replay_canvas(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, decoded: torch.Tensor,
                  step_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence a trajectory replay runs on: the batch's prompt, then every column of the
    rollout record, `decoded` and `step_map` [B, W] with W >= L. Columns past the response (block
    diffusion's terminal block running past gen_length) are not in the batch, which keeps the
    response cut for rewards, but the sampler decoded them and the block's other positions attended
    to them; they are attended here where the record says they were decoded and are padding keys
    elsewhere (a block the row never reached). Returns (targets, attention_mask), both [B, P+W]."""
    L = input_ids.shape[1] - prompt_len
    if step_map.shape[1] < L:
        raise ValueError(f"the rollout record has {step_map.shape[1]} columns, fewer than the {L} of the response")
    targets = torch.cat([input_ids[:, :prompt_len], decoded.to(input_ids)], 1)
    beyond = (step_map[:, L:] > 0).to(attention_mask)
    return targets, torch.cat([attention_mask, beyond], 1)


def ar_rows(input_ids: torch.Tensor, prompt_len: int, valid: torch.Tensor, mask_id: int) -> CorruptionSet:
    """JustGRPO's exact AR states (2.7): row t holds the prompt, y_<t, then MASK from t on, and
    scores position t where it is valid. Scoring all rows gives the exact sequence log-likelihood
    of a block-size-1, one-token-per-step rollout."""
    L = input_ids.shape[1] - prompt_len
    B = input_ids.shape[0]
    cols = torch.arange(L, device=input_ids.device)
    rows = []
    for t in range(L):
        if not valid[:, t].any():
            continue
        resp = input_ids[:, prompt_len:].masked_fill(cols >= t, mask_id)
        sc = torch.zeros_like(input_ids, dtype=torch.bool)
        sc[:, prompt_len + t] = valid[:, t].bool()
        rows.append(Corruption(torch.cat([input_ids[:, :prompt_len], resp], 1), sc, torch.ones(B)))
    return CorruptionSet(rows)


def block_local(step_map: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Step map renumbered from 1 inside each block (the BDLM form of CJ-GRPO's step map)."""
    out = torch.zeros_like(step_map)
    for blk in blocks.unique().tolist():
        inside = (blocks == blk) & (step_map > 0)
        first = step_map.masked_fill(~inside, torch.iinfo(step_map.dtype).max).min(-1, keepdim=True).values
        out = torch.where(inside, step_map - first + 1, out)
    return out
