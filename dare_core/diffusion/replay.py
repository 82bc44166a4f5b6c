"""Trajectory corruptions: the exact states a rollout went through (docs/diffusion.md#trajectory-replay, docs/diffusion.md#exact-ar).

Unlike the random laws, these do not draw anything: the rollout's step map (and, under token
editing, its edits) says which positions each denoising step wrote, and replaying step k means
feeding the model the state before it.
`tail_policy` does not apply; the tail appears exactly as the rollout had it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dare_core.diffusion.masking import Corruption, CorruptionSet


@dataclass
class WriteHistory:
    """Every token a rollout wrote at each position and the step it wrote it at
    (docs/algorithms.md#edited-rollouts): the commit from MASK, then, under token editing, each edit.
    Without editing a position has one write, its step map entry, and the history is the step map.

    steps:  [B, W, n] int, 1-based step of a position's j-th write, ascending in j; 0 = no such write.
    tokens: [B, W, n] the token the j-th write put there (anything where steps is 0).
    """

    steps: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def of_record(cls, step_map: torch.Tensor, decoded: torch.Tensor, edit_steps: Optional[torch.Tensor] = None,
                  edit_from: Optional[torch.Tensor] = None) -> "WriteHistory":
        """From a rollout record: `step_map` and `decoded` [B, W] (commit step, final token) and,
        where the rollout edited, `edit_steps` and `edit_from` [B, W, E] (each edit's step, 0 = none,
        and the token it replaced). The token a write put there is the one the next write replaced,
        or the final token for the last write."""
        steps, final = step_map[..., None], decoded[..., None]
        if edit_steps is None or edit_steps.shape[-1] == 0:
            return cls(steps, final)
        edit_steps, edit_from = edit_steps.to(step_map), edit_from.to(decoded)
        replaced_next = torch.where(edit_steps > 0, edit_from, final)  # write j's token: edit j replaced it
        return cls(torch.cat([steps, edit_steps], -1), torch.cat([replaced_next, final], -1))

    @classmethod
    def of_rollout_records(cls, records: dict, decoded: Optional[torch.Tensor] = None) -> "WriteHistory":
        """From an RL batch's records (`algorithms/rollout.py`): the step map, the final tokens
        (`decoded`, or the record's) and the edits where the rollout made any."""
        decoded = records["decoded"] if decoded is None else decoded
        return cls.of_record(records["step_map"].to(decoded.device).long(), decoded.long(), records.get("edit_steps"),
                             records.get("edit_from"))

    @property
    def slots(self) -> int:
        """Writes a position may have in this batch (1 without editing)."""
        return self.steps.shape[-1]

    def writes_before(self, k: int) -> torch.Tensor:
        """[B, W] how many writes each position had before step k (the slot of a write at step k)."""
        return ((self.steps > 0) & (self.steps < k)).sum(-1)

    def state_before(self, k: int, mask_id: int) -> torch.Tensor:
        """[B, W] what the rollout held before step k: each position's latest earlier write, MASK
        where none."""
        n = self.writes_before(k)
        latest = self.tokens.gather(-1, (n - 1).clamp_min(0)[..., None]).squeeze(-1)
        return torch.where(n > 0, latest, torch.full_like(latest, mask_id))

    def written_at(self, k: int) -> torch.Tensor:
        """[B, W] bool: the positions step k wrote (committed or edited)."""
        return (self.steps == k).any(-1)

    def token_at(self, k: int) -> torch.Tensor:
        """[B, W] the token step k wrote where it wrote one (`written_at`), the final token elsewhere."""
        hit = self.steps == k
        final = self.tokens.gather(-1, (self.steps > 0).sum(-1).clamp_min(1)[..., None] - 1).squeeze(-1)
        return torch.where(hit.any(-1), (self.tokens * hit).sum(-1), final)

    def last_step(self) -> torch.Tensor:
        """[B] the last step that wrote anything in each row."""
        return self.steps.flatten(1).max(-1).values if self.steps.numel() else torch.zeros(self.steps.shape[0])

    def edited(self) -> bool:
        return self.slots > 1 and bool((self.steps[..., 1:] > 0).any())


def replay_rows(input_ids: torch.Tensor, prompt_len: int, history: WriteHistory | torch.Tensor, scored: torch.Tensor,
                mask_id: int, targets: torch.Tensor | None = None) -> CorruptionSet:
    """One row per step k = 1..K: the state before step k (each response position's latest write
    before k, MASK where it had none), scoring `scored & written at k`. `history` is the rollout's
    `WriteHistory` over the response columns, or just its step map [B, L] (1-based, 0 = never
    decoded) when it made no edits; `targets` [B, S] the tokens the rollout finally held, when the
    batch's ids differ (e.g. block diffusion's post-EOS latents). Where a position was edited after
    step k, the token step k wrote is not its final one: the row scores it through `scored_ids`,
    while the final tokens stay the clean context (block diffusion's earlier blocks)."""
    ids = targets if targets is not None else input_ids
    if not isinstance(history, WriteHistory):
        history = WriteHistory.of_record(history, ids[:, prompt_len:])
    history = WriteHistory(history.steps.to(input_ids.device), history.tokens.to(input_ids.device))
    edited = history.edited()
    K = int(history.steps.max()) if history.steps.numel() else 0
    B = input_ids.shape[0]
    rows = []
    for k in range(1, K + 1):
        resp = history.state_before(k, mask_id).to(ids.dtype)
        noisy = torch.cat([ids[:, :prompt_len], resp], dim=1)
        sc = torch.zeros_like(ids, dtype=torch.bool)
        sc[:, prompt_len:] = history.written_at(k) & scored.bool()
        written = torch.cat([ids[:, :prompt_len], history.token_at(k).to(ids.dtype)], dim=1) if edited else None
        rows.append(Corruption(noisy, sc, torch.ones(B), None, targets, scored_ids=written))
    return CorruptionSet(rows)


def by_write(values: torch.Tensor, steps: list[int], history: WriteHistory, prompt_len: int) -> torch.Tensor:
    """Per-row scores [R, B, S] of replay rows at `steps` (each row's k) as one tensor whose
    entries each belong to one write: [B, n * S], entry j * S + i holding position i's j-th write
    (n = `history.slots`). Each write is scored by exactly one row, so no two values share an entry;
    without edits (n = 1) this is the sum over the rows."""
    if history.slots == 1:
        return values.sum(0)
    R, B, S = values.shape
    out = values.new_zeros(B, history.slots, S)
    for r, k in enumerate(steps):
        slot = torch.zeros(B, S, dtype=torch.long, device=values.device)
        # (a position step k did not write holds 0 in its row; any entry in range takes it)
        slot[:, prompt_len:] = history.writes_before(k).clamp(max=history.slots - 1).to(values.device)
        out.scatter_add_(1, slot[:, None, :], values[r][:, None, :])
    return out.flatten(1)


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
    """Step map renumbered from 1 inside each block (the BDLM form of CJ-GRPO's step map); or a
    `WriteHistory`'s steps [B, L, n], every write counted from its block's first commit."""
    commits = step_map if step_map.dim() == 2 else step_map[..., 0]
    out = torch.zeros_like(step_map)
    for blk in blocks.unique().tolist():
        inside = (blocks == blk) & (commits > 0)
        first = commits.masked_fill(~inside, torch.iinfo(commits.dtype).max).min(-1, keepdim=True).values
        if step_map.dim() == 3:
            inside, first = inside[..., None] & (step_map > 0), first[..., None]
        out = torch.where(inside, step_map - first + 1, out)
    return out
