"""The disk check counts what a training stage will really write: full checkpoints only where a
resume point is due, a weights-only one at a last step that is none (where no export holds the
weights), the copies `keep_last` lets coexist while one is written, then the export."""
import json

import pytest
import torch

from dare_core.models.lm import build_model
from dare_core.training.checkpoint import FULL, WEIGHTS, SavePolicy
from dare_core.training.preflight import checkpoint_bytes, checkpoints_need, model_bytes, training_need
from pipeline_helpers import REPO

F, W, E = 1000, 100, 100  # a full checkpoint, a weights-only one, the export (the weights again)


def need(policy: SavePolicy, keep_last: int = 2, start: int = 0, existing: int = 0) -> int:
    sizes = {FULL: F, WEIGHTS: W}
    return training_need([sizes[k] for k in policy.kinds(start)], [F] * existing, keep_last, E if policy.exports else 0)


@pytest.mark.parametrize("save_every, last, exports, kinds", [
    (200, 100, True, []),  # SFT, preference: no resume point is due, the export holds the weights
    (200, 100, False, [WEIGHTS]),  # RL: what convert reads
    (10, 30, True, [FULL] * 3),  # the last step is a resume point
    (10, 30, False, [FULL] * 3),
    (10, 35, False, [FULL] * 3 + [WEIGHTS]),
    (10, 35, True, [FULL] * 3),
    (10, 0, True, []),  # sft.max_steps 0: the start model passes through
])
def test_the_policy_writes_optimizer_state_only_at_resume_points(save_every, last, exports, kinds):
    policy = SavePolicy(save_every, last, exports)
    assert policy.kinds(0) == kinds
    assert [policy.kind(s) for s in range(1, last + 1) if policy.kind(s)] == kinds
    assert policy.kinds(last) == []  # resumed at the end: nothing left to write


def test_disk_need_counts_what_the_policy_writes():
    # save_every beyond the last step: the export alone, or one weights-only checkpoint
    assert need(SavePolicy(200, 100, exports=True)) == E
    assert need(SavePolicy(200, 100, exports=False)) == W
    # one resume point: it stays beside the export
    assert need(SavePolicy(10, 10, exports=True)) == F + E
    assert need(SavePolicy(10, 15, exports=False)) == F + W
    # many: keep_last stay, and a third is written beside them before the oldest goes
    assert need(SavePolicy(10, 40, exports=True), keep_last=2) == 3 * F
    assert need(SavePolicy(10, 40, exports=True), keep_last=1) == 2 * F
    assert need(SavePolicy(10, 45, exports=False), keep_last=2) == 3 * F  # the last weights: beside two only
    # resumed beside its two checkpoints: each new one is written before the oldest goes
    assert need(SavePolicy(10, 40, exports=True), start=20, existing=2) == F
    assert need(SavePolicy(10, 25, exports=False), start=20, existing=2) == W
    # (at the peak, at the end): the pruned checkpoints give their room back
    assert checkpoints_need([W], [F, F], keep_last=1) == (W, W - 2 * F)


def test_an_8b_sft_run_without_resume_points_needs_the_export_only():
    """The report behind this policy: full-parameter LLaDA-8B SFT on a 128 GB disk was refused
    ("about 128249298944 bytes needed, 89206804480 free": a checkpoint with Adam's state plus the
    export) although save_every > max_steps meant no resume point would be written."""
    model = build_model(json.loads((REPO / "bench" / "configs" / "LLaDA-8B-Instruct.json").read_text()), device="meta")
    full, weights = checkpoint_bytes(model, torch.bfloat16), model_bytes(model, torch.bfloat16)
    assert full + weights == 128249298944
    policy = SavePolicy(save_every=1000, last_step=500, exports=True)
    assert training_need([full for _ in policy.kinds(0)], [], 2, weights) == weights < 89206804480
    resumable = SavePolicy(save_every=250, last_step=500, exports=True)  # two resume points: both stay, beside the export
    assert training_need([full for _ in resumable.kinds(0)], [], 2, weights) == 2 * full + weights
