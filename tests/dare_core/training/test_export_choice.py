"""rl.export: the convert stage exports the best validated RL checkpoint (or the last), and the RL
stage keeps that checkpoint past rl.keep_last (training/export_choice.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dare_core.config import ConfigError, load_config
from dare_core.training.checkpoint import CheckpointManager
from dare_core.training.checkpoint_io import META, WEIGHTS_FILE
from dare_core.training.export_choice import best_validated_step, export_choice, protected_tags
from dare_core.training.fingerprint import Fingerprint


def row(step: int, mean: float, best: float = 1.0) -> dict:
    return {"step": step, "mean@4": mean, "best@4": best, "maj@4": mean, "k": 4, "prompts": 8}


def checkpoints(root: Path, steps: list[int]) -> Path:
    """Weights-only checkpoints as the RL stage writes them (the metadata, the one weights file), `latest` the last."""
    for step in steps:
        folder = root / f"step{step:08d}"
        folder.mkdir(parents=True)
        (folder / WEIGHTS_FILE).write_bytes(b"weights")
        (folder / META).write_text(json.dumps({"hf_config": {}, "step": step, "weights_only": True}))
    (root / "latest").write_text(f"step{steps[-1]:08d}")
    return root


def test_the_best_validation_wins_and_a_tie_goes_to_the_later_step():
    rows = [row(0, 1.0), row(20, 0.95), row(40, 0.95), row(60, 0.9)]
    assert best_validated_step(rows, "mean", {20, 40, 60}) == 40  # step 0 (the SFT model) has no checkpoint
    assert best_validated_step(rows, "mean", {20, 60}) == 20
    assert best_validated_step(rows, "best", {20, 60}) == 60  # best@4 ties at 1.0 everywhere
    assert best_validated_step(rows, "mean", {30}) is None
    assert protected_tags(rows, "mean", ["step00000020", "step00000060", "latest"]) == {"step00000020"}


def test_convert_chooses_the_best_validated_checkpoint_and_says_why(tmp_path):
    ckpt = checkpoints(tmp_path / "checkpoints", [20, 40, 60])
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(json.dumps(r) + "\n" for r in [row(0, 1.0), row(20, 0.97), row(40, 0.99), row(60, 0.906)]))
    choice = export_choice(ckpt, validation, "best", "mean")
    assert choice.tag == "step00000040"
    assert choice.why == ("the best validated checkpoint, step00000040: mean@4 0.990 "
                          "(the last, step 60: 0.906; rl.export: last exports it)")
    assert export_choice(ckpt, validation, "last", "mean").tag == "step00000060"
    (ckpt / "step00000040" / META).unlink()  # an incomplete checkpoint is no candidate
    assert export_choice(ckpt, validation, "best", "mean").tag == "step00000020"
    validation.unlink()  # validation off: the last, and the line says so
    choice = export_choice(ckpt, validation, "best", "mean")
    assert choice.tag == "step00000060" and "no kept checkpoint was validated" in choice.why


def test_pruning_keeps_the_protected_checkpoint(tmp_path):
    ckpt = checkpoints(tmp_path / "checkpoints", [20, 40, 60, 80])
    rows = [row(20, 0.5), row(40, 0.99), row(60, 0.7), row(80, 0.6)]
    fingerprint = Fingerprint({"rl.lr": 1.0}, {})
    manager = CheckpointManager(ckpt, 2, fingerprint, "rl", protect=lambda tags: protected_tags(rows, "mean", tags))
    manager._prune(keep="step00000080")
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000040", "step00000060", "step00000080"]
    plain = checkpoints(tmp_path / "plain", [20, 40, 60, 80])
    CheckpointManager(plain, 2, fingerprint, "rl")._prune(keep="step00000080")
    assert sorted(p.name for p in plain.glob("step*")) == ["step00000060", "step00000080"]


def test_config_keys(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("run: {seed: 0}\n")
    cfg = load_config(params)
    assert (cfg.rl.export, cfg.rl.export_metric) == ("best", "mean")
    for bad in ("rl.export=first", "rl.export_metric=median"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config(params, [bad])
