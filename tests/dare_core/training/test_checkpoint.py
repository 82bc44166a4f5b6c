"""What a training stage writes where (`SavePolicy` through `CheckpointManager.after_step`): optimizer
state only at resume points; at a last step that is none, the weights alone, which `convert` reads and
a rerun takes as "nothing left to train", never as a start of more training; or nothing where the
stage exports its weights. And the settings a checkpoint's fingerprint holds about ZeRO offload."""
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dare_core.config import DareConfig, LaunchConfig
from dare_core.models.hf_folder import load_model
from dare_core.training.checkpoint import META, WEIGHTS_FILE, CheckpointManager, CheckpointMismatch, SavePolicy, convert_checkpoint
from dare_core.training.fingerprint import Fingerprint, stage_fingerprint
from bad_input import run
from pipeline_helpers import worker_env

FINGERPRINT = Fingerprint.of({"rl": {"num_steps": 3}}, {})


class OneRankEngine:
    """The part of a one-rank ZeRO-0 DeepSpeed engine that checkpointing uses. A full save writes a
    stand-in file: only the weights-only checkpoint's contents matter here."""

    global_rank = 0

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def zero_optimization_stage(self) -> int:
        return 0

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True)
        (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"weights, optimizer")

    def load_checkpoint(self, *args, **kwargs):
        raise AssertionError("a weights-only checkpoint is never loaded to train on")


def _train(ckpts: Path, policy: SavePolicy, model, keep_last: int = 2) -> None:
    manager = CheckpointManager(ckpts, keep_last, FINGERPRINT, "rl", policy=policy)
    for step in range(1, policy.last_step + 1):
        manager.after_step(OneRankEngine(model), step, model.hf_config)


def test_a_last_step_without_resume_point_writes_the_weights_only(tmp_path, tiny_llada, caplog):
    caplog.set_level(logging.INFO, logger="dare_core.training.checkpoint")
    ckpts = tmp_path / "checkpoints"
    _train(ckpts, SavePolicy(save_every=2, last_step=3, exports=False), tiny_llada)

    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step00000002", "step00000003"]
    assert (ckpts / "latest").read_text() == "step00000003"
    assert sorted(p.name for p in (ckpts / "step00000003").iterdir()) == [META, WEIGHTS_FILE]
    said = [r.getMessage() for r in caplog.records if "save_every" in r.getMessage()]
    assert said == [f"{ckpts}: the last step, 3, is not a multiple of rl.save_every (2): a checkpoint of the weights "
                    f"only (what `dare stage convert` reads; no optimizer state)"]

    # convert reads it: the trained weights, bit for bit
    converted = load_model(convert_checkpoint(ckpts, tmp_path / "hf"))
    expected = tiny_llada.net.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in converted.net.state_dict().items())


def test_a_weights_only_checkpoint_ends_a_run_and_never_starts_training(tmp_path, tiny_llada, caplog):
    caplog.set_level(logging.INFO, logger="dare_core.training.checkpoint")
    ckpts = tmp_path / "checkpoints"
    policy = SavePolicy(save_every=5, last_step=3, exports=False)
    _train(ckpts, policy, tiny_llada)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step00000003"]  # no optimizer state at all

    # the same run again: nothing left to train (its engine is not loaded)
    again = CheckpointManager(ckpts, 2, FINGERPRINT, "rl", policy=policy)
    assert again.check() == "step00000003"
    assert again.planned_writes()[0] == []
    assert again.begin(OneRankEngine(tiny_llada), "RL") == 3
    assert "resuming RL from step00000003 (step 3, the last; weights only: nothing left to train)" in caplog.text

    # a stage that exports its engine's weights after training must not start from it
    exporting = CheckpointManager(ckpts, 2, FINGERPRINT, "rl", policy=replace(policy, exports=True))
    with pytest.raises(CheckpointMismatch, match=r"step00000003, holds the weights of step 3 only \(no optimizer state\)"):
        exporting.check()
    assert CheckpointManager(ckpts, 2, FINGERPRINT, "rl", "if_changed", policy=replace(policy, exports=True)).check() is None


def test_an_exporting_stage_writes_nothing_at_a_last_step_without_resume_point(tmp_path, tiny_llada, caplog):
    caplog.set_level(logging.INFO, logger="dare_core.training.checkpoint")
    ckpts = tmp_path / "checkpoints"
    _train(ckpts, SavePolicy(save_every=2, last_step=5, exports=True), tiny_llada, keep_last=1)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step00000004"]
    assert f"{ckpts}: the last step, 5, is not a multiple of rl.save_every (2): no checkpoint: the exported model holds " \
           f"the final weights" in caplog.text


@pytest.mark.parametrize("exports", [False, True], ids=["convert-reads", "exports"])
@pytest.mark.parametrize("last_step,save_every,keep_last", [(1, 250, 1), (6, 25, 2), (4, 4, 1), (5, 2, 1), (7, 3, 5)])
def test_the_checkpoint_folder_exists_after_any_run_length(tmp_path, tiny_llada, last_step, save_every, keep_last, exports):
    """The folder is a declared output of its stage (dvc.yaml): DVC fails a stage whose output is
    missing, so a run shorter than save_every (SFT's smoke run, the preference stage's 6 steps) must
    leave it too, empty where nothing was due; a rerun over it then resumes or ends as before."""
    ckpts = tmp_path / "run" / "checkpoints"
    policy = SavePolicy(save_every=save_every, last_step=last_step, exports=exports)
    manager = CheckpointManager(ckpts, keep_last, FINGERPRINT, "rl", policy=policy)
    assert manager.check() is None and manager.begin(OneRankEngine(tiny_llada), "RL") == 0
    for step in range(1, last_step + 1):
        manager.after_step(OneRankEngine(tiny_llada), step, tiny_llada.hf_config)

    assert ckpts.is_dir()
    written = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step"))
    due = [s for s in range(1, last_step + 1) if policy.kind(s)]
    assert written == [f"step{s:08d}" for s in due[-keep_last:]]
    again = CheckpointManager(ckpts, keep_last, FINGERPRINT, "rl", policy=policy)
    assert again.check() == (written[-1] if written else None)


def test_the_fingerprint_holds_the_optimizer_offload_only():
    """DeepSpeed cannot load torch AdamW's state into DeepSpeedCPUAdam: an offloaded run's checkpoints
    are refused, by name, to a run without (recorded only when on, so that checkpoints made before the
    setting existed resume). ZeRO-3's checkpoints are the same with and without parameter offload."""
    def fingerprint(**launch) -> Fingerprint:
        return stage_fingerprint(DareConfig(launch=LaunchConfig(zero_stage=3, **launch)), "rl", {})

    plain = fingerprint()
    assert plain.settings["launch.zero_stage"] == 3 and "launch.offload_optimizer" not in plain.settings
    assert fingerprint(offload_params="cpu").digest == plain.digest
    offloaded = fingerprint(offload_optimizer="cpu", offload_params="cpu")
    meta = {"settings": plain.settings, "inputs": plain.inputs}
    assert offloaded.changes(meta) == ['launch.offload_optimizer: (not set) -> "cpu"']


def test_the_fingerprint_holds_sequence_parallelism_when_on():
    """Groups of launch.sequence_parallel ranks divide the data: a checkpoint made with another N
    trained on another data order (recorded only when on: checkpoints of N = 1 made before the
    setting existed resume)."""
    def fingerprint(n: int) -> Fingerprint:
        return stage_fingerprint(DareConfig(launch=LaunchConfig(launcher="torchrun", nproc=2, sequence_parallel=n)), "sft", {})

    plain = fingerprint(1)
    assert "launch.sequence_parallel" not in plain.settings
    assert fingerprint(2).changes({"settings": plain.settings, "inputs": plain.inputs}) == \
        ["launch.sequence_parallel: (not set) -> 2"]


def _weights(folder: Path) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_rl_without_resume_points_keeps_no_optimizer_state_yet_converts(project):
    """The real stage: RL with save_every beyond num_steps writes one checkpoint, of the weights; the
    convert stage makes of it the model the project's RL run (full checkpoint at step 2, weights at
    step 3) converted to. (A rerun then finds nothing left to train: test_bad_input_stages.py's
    test_restart_if_changed_resumes_matching_checkpoints_and_sets_others_aside resumes the project's
    weights-only step 3.)"""
    converted = _weights(project / "models" / "t")
    ckpts = project / "runs" / "t" / "rl" / "checkpoints"
    r = run(project, "stage", "rl", "--restart", "-S", "rl.save_every=100")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the last step, 3, is not a multiple of rl.save_every (100): a checkpoint of the weights only" in r.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step00000003"]
    assert sorted(p.name for p in (ckpts / "step00000003").iterdir()) == [META, WEIGHTS_FILE]

    r = run(project, "stage", "convert")
    assert r.returncode == 0, r.stderr[-3000:]
    again = _weights(project / "models" / "t")
    assert again.keys() == converted.keys() and all(torch.equal(again[k], converted[k]) for k in again)


_ZERO3_WEIGHTS_ONLY = r"""
import sys
from pathlib import Path
import torch
from conftest import make_tiny_llada
from dare_core.config import LaunchConfig, OptimConfig
from dare_core.training import engine as eng
from dare_core.training.checkpoint import CheckpointManager, checkpoint_state_dict
from dare_core.training.fingerprint import Fingerprint

# a wide MLP: its weights are above ZeRO-3's persistence threshold, so they are partitioned
model = make_tiny_llada(mlp_hidden_size=3200).train()
engine = eng.build_engine(model, OptimConfig(lr=1e-2), 10, 1, 1, LaunchConfig(zero_stage=3, offload_optimizer="cpu"))
engine.backward(engine(torch.arange(16)[None] % 38).float().pow(2).mean())
engine.step()
assert any(p.numel() == 0 for p in engine.module.parameters()), "nothing partitioned"
ckpts = Path(sys.argv[1])
manager = CheckpointManager(ckpts, 2, Fingerprint.of({}, {}), "rl")
manager.save(engine, 1, {"step": 1}, model.hf_config)
manager.save(engine, 2, {"step": 2}, model.hf_config, weights_only=True)
full, _ = checkpoint_state_dict(ckpts, "step00000001")
weights, _ = checkpoint_state_dict(ckpts, "step00000002")
print("SAME", full.keys() == weights.keys() and all(torch.equal(full[k], weights[k]) for k in full))
"""


def test_a_zero3_weights_only_checkpoint_holds_what_convert_makes_of_a_full_one(tmp_path):
    """Under ZeRO-3 (optimizer offloaded, as for full-parameter 8B) the weights-only checkpoint gathers
    the partitioned weights: they equal what DeepSpeed's consolidation of the full checkpoint's fp32
    shards gives, bit for bit."""
    r = subprocess.run([sys.executable, "-c", _ZERO3_WEIGHTS_ONLY, str(tmp_path / "checkpoints")], cwd=Path(__file__).parents[2],
                       env=worker_env(), capture_output=True, text=True, timeout=300)
    assert "SAME True" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
