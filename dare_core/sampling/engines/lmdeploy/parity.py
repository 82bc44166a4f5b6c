"""Teacher-forced parity of lmdeploy's model with DARE's (docs/sampling.md#engines).

The engine's probe (`LMDeployEngine.probe`) records every forward lmdeploy made: the tokens it fed at
which positions, and the logits it computed for the block it decodes. DARE's model is then forced
onto exactly that trajectory: for each record it reads the same tokens (the context lmdeploy's KV
cache held, then the block) at the same positions and gives the same rows, uncached with its
block-causal mask, which equals its block KV cache (tested in tests/dare_core/sampling). Any
difference is the two models' arithmetic, not the decoding order or the cache.

A greedy pick is decided by the two best logits; where their gap is within the two models' error,
either pick is right. So agreement is reported overall and where DARE's gap is clear of it
(`clear_margin` times the largest logit error seen), where it must be complete.
"""
from __future__ import annotations

from typing import Sequence

import torch


def replay_logits(model, records: Sequence[dict], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(lmdeploy's logits, DARE's), [N, V] each in float32, of records made one request at a time."""
    tokens: list[int] = []
    theirs, ours = [], []
    for r in records:
        if len(r["history"]) != 1:
            raise ValueError(f"a record of {len(r['history'])} sequences: probe one request at a time")
        h, q = r["history"][0], r["seq_length"][0]
        if h > len(tokens):
            raise ValueError(f"a record at position {h} after {len(tokens)} known tokens: records of one request, in order")
        tokens[h:] = r["input_ids"][:q]
        with torch.no_grad():
            logits = model(torch.tensor([tokens], device=device))[0]
        n = r["logits"].shape[0]
        theirs.append(r["logits"].float())
        ours.append(logits[-n:].float().cpu())
    return torch.cat(theirs), torch.cat(ours)


def compare(theirs: torch.Tensor, ours: torch.Tensor, clear_margin: float = 2.0) -> dict:
    """Max and mean absolute logit error (also relative to the logits' spread), argmax agreement
    overall and where DARE's top-2 gap exceeds `clear_margin` x the max error."""
    if theirs.shape != ours.shape:
        raise ValueError(f"logits of shapes {tuple(theirs.shape)} and {tuple(ours.shape)}")
    err = (theirs - ours).abs()
    max_err = err.max().item()
    top2 = ours.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    same = theirs.argmax(-1) == ours.argmax(-1)
    clear = gap > clear_margin * max_err
    return {"rows": int(ours.shape[0]), "max_abs_err": max_err, "mean_abs_err": err.mean().item(),
            "logit_std": ours.std().item(), "max_err_over_std": max_err / max(ours.std().item(), 1e-12),
            "argmax_agreement": same.float().mean().item(), "clear_rows": int(clear.sum()),
            "argmax_agreement_clear": same[clear].float().mean().item() if clear.any() else float("nan"),
            "median_top2_gap": gap.median().item()}
