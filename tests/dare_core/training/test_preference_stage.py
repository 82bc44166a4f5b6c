"""`dare stage preference` end to end on a tiny config: finite metrics, an exported model folder that
loads, a re-run that resumes from its checkpoints to the weights of an uninterrupted run, and bad
input as one clear error."""
import json
import math
import shutil
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from dare_core.config import load_config
from dare_core.data.prepare import prepare
from pipeline_helpers import dare, tiny_params, worker_env, write_params


def _weights(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _run(params: Path, stage: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(dare("stage", stage, "--params", str(params), *extra), env=worker_env(), capture_output=True, text=True)


def _setup(root: Path, **over) -> Path:
    params = write_params(root / "params.yaml", tiny_params(root, **over))
    prepare(load_config(params))
    r = _run(params, "sft")
    assert r.returncode == 0, r.stderr[-3000:]
    return params


def test_preference_stage_trains_exports_and_resumes(tmp_path):
    params = _setup(tmp_path, preference__max_steps=6, preference__save_every=2, preference__keep_last=3, preference__log_every=1)
    r = _run(params, "preference")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "runs" / "t" / "preference"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == list(range(1, 7))
    for m in rows:
        assert all(math.isfinite(m[k]) for k in ("loss", "reward_margin", "reward_accuracy", "lr"))
        assert 0.0 <= m["reward_accuracy"] <= 1.0
    # step 1 starts at the reference: the shared-mask logit is exactly 0, the loss log 2
    assert rows[0]["loss"] == round(math.log(2), 6) and rows[0]["reward_margin"] == 0.0
    summary = json.loads((tmp_path / "metrics" / "preference.json").read_text())
    assert summary["algorithm"] == "vrpo" and summary["shared_masks"] and summary["stratified"] and summary["steps"] == 6
    assert math.isfinite(summary["final_loss"])
    assert (out / "loss.csv").read_text().startswith("step,loss") and (out / "reward_accuracy.csv").exists()

    from dare_core.models.hf_folder import load_model
    from dare_core.models.tokenizer import load_tokenizer

    model, tok = load_model(out / "model"), load_tokenizer(out / "model")
    sft = load_model(tmp_path / "runs" / "t" / "sft" / "model")
    assert model.mask_token_id == tok.mask_token_id
    x = torch.randint(0, 20, (1, 8))
    assert not torch.equal(model(x), sft(x))  # it trained, from the SFT model
    first = _weights(out / "model")

    # a run that stopped after step 4: its last checkpoint is step 4 and it exported nothing
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step00000002", "step00000004", "step00000006"]
    shutil.rmtree(ckpts / "step00000006")
    (ckpts / "latest").write_text("step00000004")
    shutil.rmtree(out / "model")
    r = _run(params, "preference")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming preference from step00000004" in r.stderr
    again = _weights(out / "model")
    assert first.keys() == again.keys()
    for k in first:
        assert torch.equal(first[k], again[k]), k
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == list(range(1, 7))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in rows]


def test_elbo_dpo_with_lora(tmp_path):
    """Plain ELBO-DPO, LoRA adapters: the reference is the adapter-disabled model (no copy)."""
    params = _setup(tmp_path, model__lora={"r": 4, "alpha": 8}, sft__max_steps=4, preference__algorithm="elbo_dpo",
                    preference__max_steps=3, preference__log_every=1)
    r = _run(params, "preference")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs/t/preference/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(math.isfinite(m["loss"]) for m in rows)
    assert rows[0]["reward_margin"] != 0.0  # independent reference masks: noisy from the first step
    summary = json.loads((tmp_path / "metrics" / "preference.json").read_text())
    assert summary["algorithm"] == "elbo_dpo" and not summary["shared_masks"] and not summary["stratified"]
    from dare_core.models.hf_folder import load_model

    load_model(tmp_path / "runs/t/preference/model")  # merged weights: a plain checkpoint


def test_bad_preference_input_is_one_clear_error(tmp_path):
    params = write_params(tmp_path / "params.yaml", tiny_params(tmp_path))
    prepare(load_config(params))
    r = _run(params, "preference")  # no SFT model yet
    assert r.returncode == 2 and "sft/model" in r.stderr and "Traceback" not in r.stderr

    import pyarrow.parquet as pq

    path = tmp_path / "data" / "prepared" / "preference.parquet"
    pq.write_table(pq.read_table(path).drop(["rejected"]), path)
    r = _run(params, "preference")
    assert r.returncode == 2 and "preference.parquet: row 1:" in r.stderr and "rejected" in r.stderr
    assert not (tmp_path / "runs" / "t" / "preference").exists()
    pq.write_table(pq.read_table(path).slice(0, 0), path)  # no pairs at all: an error only where they are required
    r = _run(params, "preference", "-S", "preference.enabled=true")
    assert r.returncode == 2 and "no preference pairs, but preference.enabled is true" in r.stderr, r.stderr
    assert not (tmp_path / "runs" / "t" / "preference").exists()
    r = _run(params, "preference")  # auto: the stage is off (training/preference_off.py)
    assert r.returncode == 0 and "preference stage off: no preference pairs" in r.stderr, r.stderr
    r = _run(params, "preference", "-S", "preference.algorithm=dpo")
    assert r.returncode == 2 and "unknown preference algorithm 'dpo'" in r.stderr
