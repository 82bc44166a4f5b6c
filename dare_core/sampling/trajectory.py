"""What a rollout records beyond token ids, on request (docs/sampling.md#rollout-records).

Positions are columns of the *decoding window*: the part of the canvas from the first decoding
block on. For masked diffusion that is the response itself; for block diffusion the first block
starts at the last prompt-block boundary, so the window begins with the prompt's tail and
`response_offset[b]` says where row b's response starts. Blocks are aligned to the window's origin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from dare_core.diffusion.replay import WriteHistory


@dataclass
class Trajectory:
    tokens: torch.Tensor  # [B, W] every decoded token, including those after EOS in the terminal block; MASK where never decoded
    step_map: torch.Tensor  # [B, W] int32, 1-based step (per row) that committed the position; 0 = not committed by the sampler
    response_offset: torch.Tensor  # [B] first response column of each row inside the window
    num_steps: torch.Tensor  # [B] denoising steps the row took part in
    block_length: int
    mask_token_id: int
    x0_hat: Optional[torch.Tensor] = None  # [B, K, W] int32 proposals of each step for the block being decoded, -1 elsewhere
    confidence: Optional[torch.Tensor] = None  # [B, K, W] float32 confidences of those proposals, NaN elsewhere
    # token editing: [B, W, E] the step of each position's e-th edit (0 = none, ascending) and the
    # token that edit replaced; E = 0 when nothing was edited (`WriteHistory`)
    edit_steps: Optional[torch.Tensor] = None
    edit_from: Optional[torch.Tensor] = None

    def _response_columns(self, values: torch.Tensor, gen_length: int, fill) -> torch.Tensor:
        """[B, gen_length, ...] of window-column values [B, W, ...] in response coordinates."""
        idx = self.response_offset[:, None] + torch.arange(gen_length, device=values.device)
        inside = idx < values.shape[1]
        idx = idx.clamp(max=values.shape[1] - 1).view(*idx.shape, *([1] * (values.dim() - 2)))
        out = values.gather(1, idx.expand(-1, -1, *values.shape[2:]))
        return out.masked_fill(~inside.view(*inside.shape, *([1] * (values.dim() - 2))), fill)

    def response_edits(self, gen_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(edit_steps, edit_from) [B, gen_length, E] in response coordinates (E = 0 without edits)."""
        if self.edit_steps is None:
            empty = torch.zeros((*self.step_map.shape[:1], gen_length, 0), dtype=torch.int32, device=self.step_map.device)
            return empty, empty.clone()
        return (self._response_columns(self.edit_steps, gen_length, 0),
                self._response_columns(self.edit_from, gen_length, self.mask_token_id))

    def history(self, rows: slice = slice(None)) -> WriteHistory:
        """Every write of the window's positions (commits and edits) of `rows`, in window columns."""
        edits = (None, None) if self.edit_steps is None else (self.edit_steps[rows], self.edit_from[rows])
        return WriteHistory.of_record(self.step_map[rows], self.tokens[rows], *edits)

    def response_step_map(self, gen_length: int) -> torch.Tensor:
        """[B, gen_length] step map in response coordinates (what CJ-GRPO / d-TreeRPO consume)."""
        return self._response_columns(self.step_map, gen_length, 0)

    def response_tokens(self, gen_length: int) -> torch.Tensor:
        """[B, gen_length] what the sampler decoded at each response position, including tokens
        after a stop (MASK where never decoded): the targets of a trajectory replay."""
        return self._response_columns(self.tokens, gen_length, self.mask_token_id)

    def block_local_steps(self) -> torch.Tensor:
        """Steps counted from 1 inside each block (the BDLM form of CJ-GRPO's step map)."""
        out = torch.zeros_like(self.step_map)
        width = self.step_map.shape[1]
        for lo in range(0, width, self.block_length):
            blk = self.step_map[:, lo:lo + self.block_length]
            first = blk.masked_fill(blk == 0, torch.iinfo(blk.dtype).max).min(-1, keepdim=True).values
            out[:, lo:lo + self.block_length] = torch.where(blk > 0, blk - first + 1, blk)
        return out

    def states(self, row: int) -> Iterator[torch.Tensor]:
        """The window's state before each step k = 1..K of one row: tokens committed earlier, the
        prompt tail, MASK elsewhere. Replaying the trajectory is feeding these back to the model."""
        toks = self.tokens[row]
        fixed = torch.arange(toks.shape[0], device=toks.device) < self.response_offset[row]
        one = self.history(slice(row, row + 1))
        for k in range(1, int(self.num_steps[row]) + 1):
            yield torch.where(fixed, toks, one.state_before(k, self.mask_token_id)[0])

    def validate(self, valid: torch.Tensor, allow_empty_steps: bool = False) -> None:
        """6.5's rules, for `valid` [B, W] the positions that must carry a step (the response up to
        its stop): every valid position has exactly one step, padding none, and the steps of a block
        are contiguous from 1. A count schedule that may commit nothing on a step (Dream's
        floor(m(1 - s/t)) can be 0) leaves gaps; `allow_empty_steps` accepts those."""
        if ((self.step_map > 0) != valid).any():
            raise ValueError("trajectory: a valid position has no step, or padding has one")
        local = self.block_local_steps()
        for lo in range(0, local.shape[1], self.block_length):
            blk = local[:, lo:lo + self.block_length]
            for b in range(blk.shape[0]):
                used = sorted(set(blk[b][blk[b] > 0].tolist()))
                if used and not allow_empty_steps and used != list(range(1, used[-1] + 1)):
                    raise ValueError(f"trajectory: steps of row {b}, block at {lo} are not contiguous from 1: {used}")


def record_width(gen_length: int, block_size: Optional[int]) -> int:
    """Response columns of a replay record ("step_map", "decoded"; 6.5). Block diffusion's blocks sit
    on absolute positions, so a row's terminal block can run up to B_s - 1 columns past gen_length;
    the sampler decoded those columns and the block's other positions attended to them, so a replay
    that equals the rollout needs them too (the response itself stays cut at gen_length). Masked
    diffusion's blocks end with the response. The width depends on the model only, so that records
    of different rollout chunks concatenate."""
    return gen_length + (block_size - 1 if block_size else 0)


class TrajectoryRecorder:
    """Collects the per-step record while the loop runs; rows are original batch indices."""

    def __init__(self, batch: int, width: int, origin: int, full: bool, device):
        self.origin, self.full = origin, full
        self.step_map = torch.zeros((batch, width), dtype=torch.int32, device=device)
        self.frames: list = []  # full: (rows, step per row, lo, proposal, confidence)
        self.edits: list = []  # token editing: (rows, window columns, steps, tokens replaced), one entry a step

    def record(self, rows: torch.Tensor, step: torch.Tensor, lo: int, commit: torch.Tensor,
               proposal: torch.Tensor, confidence: torch.Tensor, before: Optional[torch.Tensor] = None) -> None:
        """`commit` [r, n]: the positions of the block at `lo` this step wrote; those already
        committed are edits (given `before`, the block's tokens before the step)."""
        a = lo - self.origin
        cols = self.step_map[rows, a:a + commit.shape[1]]
        if before is not None:
            r, c = (commit & (cols > 0)).nonzero(as_tuple=True)
            if r.numel():
                self.edits.append((rows[r], a + c, step[r].to(torch.int32), before[r, c].to(torch.int32)))
        self.step_map[rows, a:a + commit.shape[1]] = torch.where(commit & (cols == 0), step[:, None].to(torch.int32), cols)
        if self.full:
            self.frames.append((rows.cpu(), step.cpu(), a, proposal.to(torch.int32).cpu(), confidence.float().cpu()))

    def finish(self, tokens: torch.Tensor, response_offset: torch.Tensor, num_steps: torch.Tensor,
               block_length: int, mask_id: int) -> Trajectory:
        traj = Trajectory(tokens, self.step_map, response_offset, num_steps, block_length, mask_id)
        if self.edits:
            traj.edit_steps, traj.edit_from = self._edit_columns()
        if self.full:
            b, w = tokens.shape
            k = int(num_steps.max()) if num_steps.numel() else 0
            x0 = torch.full((b, k, w), -1, dtype=torch.int32)
            conf = torch.full((b, k, w), float("nan"))
            for rows, step, a, prop, c in self.frames:
                n = prop.shape[1]
                x0[rows, step - 1, a:a + n] = prop
                conf[rows, step - 1, a:a + n] = c
            traj.x0_hat, traj.confidence = x0, conf
        return traj

    def _edit_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The edits as [B, W, E] columns: a position's e-th edit (in step order) at e."""
        count = torch.zeros_like(self.step_map, dtype=torch.long)
        slots = []
        for rows, cols, _, _ in self.edits:  # (an entry holds each position once)
            slots.append(count[rows, cols].clone())
            count[rows, cols] += 1
        e = int(count.max())
        steps = torch.zeros((*self.step_map.shape, e), dtype=torch.int32, device=self.step_map.device)
        replaced = torch.zeros_like(steps)
        for (rows, cols, step, before), slot in zip(self.edits, slots):
            steps[rows, cols, slot] = step
            replaced[rows, cols, slot] = before
        return steps, replaced
