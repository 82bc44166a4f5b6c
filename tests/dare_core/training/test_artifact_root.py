"""run.artifact_root against a real S3 endpoint (moto's server on 127.0.0.1): a short SFT run puts
its checkpoints (each as it is saved, keep_last mirrored), model, metrics and plots in the bucket; a
run with no local checkpoints resumes from the bucket's latest complete one to the weights of an
uninterrupted run; checkpoints of other settings are refused, naming the URL; no credential is
ever printed or written."""
from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from dare_core.artifacts import ArtifactRoot, publish_stage
from dare_core.config import load_config
from dare_core.data.prepare import prepare
from dare_core.training.checkpoint import CheckpointManager, CheckpointMismatch
from dare_core.training.fingerprint import Fingerprint
from pipeline_helpers import tiny_params, worker_env, write_params
from s3_server import ACCESS_KEY, SECRET, s3_bucket, s3_server  # noqa: F401  (fixtures)


def _weights(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _project(root: Path, artifact_root: str, **over) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    params = tiny_params(root, run__artifact_root=artifact_root, **over)
    # relative, as in a real project: the remote layout and the printed paths start at runs/, metrics/, ...
    params["run"].update(runs_dir="runs", models_dir="models", metrics_dir="metrics")
    params["data"].update(prepared_dir="data/prepared", tokenizer_dir="data/tokenizer")
    return write_params(root / "params.yaml", params)


def test_sft_artifacts_reach_the_bucket_and_a_run_resumes_from_them(tmp_path, s3_bucket, monkeypatch, capfd):
    from dare_core.cli import main

    root = tmp_path / "project"
    _project(root, f"s3://{s3_bucket}/dare", sft__max_steps=20, sft__save_every=5, sft__keep_last=2)
    monkeypatch.chdir(root)
    for key, value in worker_env().items():  # the worker process finds the repository and the AWS_* settings
        monkeypatch.setenv(key, value)
    prepare(load_config("params.yaml"))
    assert main(["stage", "sft"]) == 0
    first = capfd.readouterr()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    base = f"{s3_bucket}/dare/t"
    remote = {p[len(base) + 1:] for p in fs.find(base)}
    ckpts = "runs/t/sft/checkpoints"
    # keep_last 2, mirrored: the pruned checkpoints are gone from the bucket too
    assert sorted({p.split("/")[4] for p in remote if p.startswith(ckpts + "/step")}) == ["step00000015", "step00000020"]
    assert {f"{ckpts}/step00000015/dare_checkpoint.json", f"{ckpts}/step00000020/dare_checkpoint.json",
            f"{ckpts}/latest"} <= remote
    assert fs.cat(f"{base}/{ckpts}/latest") == b"step00000020"
    local = {p.relative_to(root).as_posix() for top in ("runs", "metrics") for p in (root / top).rglob("*") if p.is_file()}
    assert local - remote == set() and remote - local == set()  # everything, as written
    for rel in ("runs/t/sft/model/config.json", "runs/t/sft/metrics.jsonl", "runs/t/sft/loss.csv", "metrics/sft.json",
                "runs/t/base/config.json"):
        assert fs.cat(f"{base}/{rel}") == (root / rel).read_bytes(), rel
    url = f"s3://{s3_bucket}/dare/t"
    assert f"uploaded runs/t/sft/checkpoints/step00000005 -> {url}/{ckpts}/step00000005 (" in first.out
    assert f"uploaded runs/t/sft/model -> {url}/runs/t/sft/model (" in first.out
    assert f"uploaded metrics/sft.json -> {url}/metrics/sft.json (1 file, " in first.out
    want = _weights(root / "runs/t/sft/model")

    # another machine: nothing local, and the bucket's last upload (step 20) was cut short, so the
    # newest complete checkpoint is step 15: it is fetched and the run continues from it
    shutil.rmtree(root / "runs"), (root / "metrics/sft.json").unlink()
    fs.rm(f"{base}/{ckpts}/step00000020/dare_checkpoint.json")
    assert main(["stage", "sft"]) == 0
    second = capfd.readouterr()
    assert f"restored checkpoint step00000015 from {url}/{ckpts}/step00000015" in second.out
    assert "resuming SFT from step00000015" in second.err
    got = _weights(root / "runs/t/sft/model")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert fs.cat(f"{base}/{ckpts}/latest") == b"step00000020"

    # no credential anywhere: not in any output, nor in any file the runs wrote
    for text in (first.out, first.err, second.out, second.err):
        assert SECRET not in text and ACCESS_KEY not in text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data and ACCESS_KEY.encode() not in data, path


def test_checkpoints_of_other_settings_in_the_artifact_root_are_refused(tmp_path, s3_bucket, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(_project(tmp_path, f"s3://{s3_bucket}/dare"))
    ckpt_dir = tmp_path / "runs/t/sft/checkpoints"
    root = ArtifactRoot(cfg)
    made = Fingerprint.of({"sft": {"optim": {"lr": 0.003}}}, {})
    (ckpt_dir / "step00000010").mkdir(parents=True)
    (ckpt_dir / "step00000010" / "dare_checkpoint.json").write_text(
        f'{{"fingerprint": "{made.digest}", "settings": {{"sft.optim.lr": 0.003}}, "inputs": {{}}}}')
    (ckpt_dir / "latest").write_text("step00000010")
    root.sync_checkpoints(ckpt_dir)
    shutil.rmtree(tmp_path / "runs")

    now = Fingerprint.of({"sft": {"optim": {"lr": 0.01}}}, {})
    with pytest.raises(CheckpointMismatch, match=rf"s3://{s3_bucket}/dare/t/runs/t/sft/checkpoints/step00000010: the "
                                                 r"artifact root's checkpoint was made with other settings or inputs "
                                                 r"\(sft.optim.lr: 0.003 -> 0.01\)"):
        CheckpointManager(ckpt_dir, 2, now, "sft", mirror=root).check()
    # --restart-if-changed: a fresh start, nothing fetched, the remote checkpoint left as it was
    assert CheckpointManager(ckpt_dir, 2, now, "sft", "if_changed", mirror=root).check() is None
    assert not ckpt_dir.exists()
    assert CheckpointManager(ckpt_dir, 2, made, "sft", mirror=root).check() == "step00000010"  # same settings: resumed


def test_a_local_folder_as_artifact_root_mirrors_the_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(_project(tmp_path, str(tmp_path / "copies")))
    prepare(cfg)
    publish_stage(cfg, "prepare")
    copy = tmp_path / "copies" / "t" / "data"
    assert sorted(p.name for p in (copy / "prepared").iterdir()) == sorted(p.name for p in (tmp_path / "data/prepared").iterdir())
    assert (copy / "tokenizer" / "tokenizer_config.json").read_bytes() == \
        (tmp_path / "data/tokenizer/tokenizer_config.json").read_bytes()
    (copy / "prepared" / "stale.parquet").write_text("old")  # no longer an output: removed by the next copy
    publish_stage(cfg, "prepare")
    assert not (copy / "prepared" / "stale.parquet").exists()


def test_dare_upload_copies_a_stage_that_did_not_run_and_missing_sends_only_what_the_root_lacks(tmp_path, monkeypatch,
                                                                                                 capsys):
    """`dare upload` is what the flow runs for a stage DVC restored from its cache (the stage's own
    upload) or found up to date (`--missing`: checked by name and size, so an edit of the same size
    goes unnoticed, as documented; a plain `dare upload` sends everything)."""
    from dare_core.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = load_config(_project(tmp_path, str(tmp_path / "copies")))
    assert main(["upload", "prepare"]) == 2
    assert "error: stage prepare has no outputs here" in capsys.readouterr().err
    prepare(cfg)
    assert main(["upload", "prepare"]) == 0
    copy, local = tmp_path / "copies" / "t" / "data", tmp_path / "data"
    gone, longer, same_size = copy / "prepared/sft.parquet", copy / "prepared/summary.json", copy / "tokenizer/tokenizer_config.json"
    gone.unlink()
    longer.write_text(longer.read_text() + " ")
    same_size.write_bytes(b"x" * same_size.stat().st_size)
    (copy / "prepared" / "stale.parquet").write_text("old")
    capsys.readouterr()
    assert main(["upload", "prepare", "--missing"]) == 0
    told = capsys.readouterr().out
    assert "uploaded data/prepared -> " in told and "(2 files," in told and "already uploaded: data/tokenizer -> " in told
    assert gone.read_bytes() == (local / "prepared/sft.parquet").read_bytes()
    assert longer.read_bytes() == (local / "prepared/summary.json").read_bytes()
    assert not (copy / "prepared" / "stale.parquet").exists() and same_size.read_bytes().strip(b"x") == b""
    assert main(["upload", "prepare"]) == 0
    assert same_size.read_bytes() == (local / "tokenizer/tokenizer_config.json").read_bytes()
    # nowhere to upload to: one line saying so
    assert main(["upload", "prepare", "-S", "run.artifact_root=null"]) == 2
    assert capsys.readouterr().err.strip() == ("error: params.yaml: run.artifact_root is not set, so there is nowhere to "
                                               "upload to (set it to s3://bucket/prefix or a folder)")
