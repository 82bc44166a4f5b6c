"""A killed SFT run resumes from its last checkpoint to exactly the weights of an uninterrupted run;
bad input fails with one clear error and writes nothing."""
import json
import signal
import subprocess
import time
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


def _setup(root: Path, **over) -> Path:
    params = write_params(root / "params.yaml", tiny_params(root, **over))
    prepare(load_config(params))
    return params


def test_killed_sft_resumes_to_identical_weights(tmp_path):
    over = {"sft__max_steps": 300, "sft__save_every": 20, "sft__log_every": 10, "sft__micro_batch_size": 32,
            "model__init": {"d_model": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden_size": 128, "max_sequence_length": 24}}
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    pa, pb = _setup(a, **over), _setup(b, **over)
    env = worker_env()
    subprocess.run(dare("stage", "sft", "--params", str(pa)), check=True, env=env, capture_output=True)

    ckpts = b / "runs" / "t" / "sft" / "checkpoints"
    proc = subprocess.Popen(dare("stage", "sft", "--params", str(pb)), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (ckpts / "latest").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    import os

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = int((ckpts / "latest").read_text().strip()[len("step"):])
    assert 0 < killed_at < 300, "the run must be killed in the middle"
    assert not (b / "runs" / "t" / "sft" / "model").exists()

    resumed = subprocess.run(dare("stage", "sft", "--params", str(pb)), env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming SFT from step{killed_at:08d}" in resumed.stderr
    wa, wb = _weights(a / "runs" / "t" / "sft" / "model"), _weights(b / "runs" / "t" / "sft" / "model")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    steps = [json.loads(line)["step"] for line in (b / "runs" / "t" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 300
    # only the last K checkpoints are kept, all complete
    kept = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    assert kept == ["step00000280", "step00000300"]


def test_missing_dataset_file_is_one_clear_error_and_writes_nothing(tmp_path):
    params = write_params(tmp_path / "params.yaml", tiny_params(tmp_path))
    r = subprocess.run(dare("stage", "sft", "--params", str(params)), env=worker_env(), capture_output=True, text=True)
    assert r.returncode == 2
    assert "sft.parquet" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


def test_unknown_config_key_is_named(tmp_path):
    params = write_params(tmp_path / "params.yaml", tiny_params(tmp_path))
    r = subprocess.run(dare("stage", "sft", "--params", str(params), "-S", "sft.lrr=0.1"), env=worker_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "unknown config key 'sft.lrr'" in r.stderr
    bad = tiny_params(tmp_path)
    bad["rl"]["sampler"]["temprature"] = 0.5
    write_params(params, bad)
    r = subprocess.run(dare("stage", "prepare", "--params", str(params)), env=worker_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "rl.sampler.temprature" in r.stderr and "did you mean 'temperature'" in r.stderr
    assert not (tmp_path / "data").exists()


def test_malformed_prepared_row_names_file_and_row(tmp_path):
    params = _setup(tmp_path)
    import pyarrow.parquet as pq

    path = tmp_path / "data" / "prepared" / "sft.parquet"
    table = pq.read_table(path).drop(["response"])
    pq.write_table(table, path)
    r = subprocess.run(dare("stage", "sft", "--params", str(params)), env=worker_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "sft.parquet: row 1:" in r.stderr and "response" in r.stderr
    assert not (tmp_path / "runs" / "t" / "sft" / "model").exists()
