"""The RL stage with lmdeploy rollouts (GPU): a tiny SDAR trained a few SFT steps, then RL steps whose
rollouts come from lmdeploy's own process on each rank's GPU, the policy's weights pushed to it after
every update (docs/sampling.md#engines)."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from dare_core.config import load_config
from dare_core.data.prepare import prepare
from pipeline_helpers import dare, tiny_params, worker_env, write_params

SDAR_INIT = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
             "intermediate_size": 256, "max_position_embeddings": 64}
# what lmdeploy honours exactly (the untempered confidence of the sampled token, one commit per step)
SAMPLER = {"gen_length": 4, "steps": 4, "block_length": 4, "temperature": 1.0, "remasking": "low_confidence",
           "unmasking": "topk", "cache": "block_kv", "batch_size": 16, "engine": "lmdeploy"}


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [1, 2])
def test_rl_steps_with_lmdeploy_rollouts(tmp_path, nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"{nproc} GPUs needed")
    logs = tmp_path / "engine_logs"
    params = write_params(tmp_path / "params.yaml", tiny_params(
        tmp_path, model__family="sdar", model__init=SDAR_INIT, sft__max_steps=20, rl__num_steps=3, rl__save_every=3,
        rl__validate_every=0, rl__sampler={**SAMPLER, "engine_args": {"cache_max_entry_count": 0.05, "log_dir": str(logs)}},
        launch__nproc=nproc, launch__launcher="torchrun" if nproc > 1 else "local"))
    prepare(load_config(params))
    env = {**worker_env(), "DARE_PHASE_TIMES": "1"}
    for stage in ("sft", "rl"):
        r = subprocess.run(dare("stage", stage, "--params", str(params)), env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "t" / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "time/step_s" in m]
    assert steps and all(m["time/weight_sync_s"] > 0 for m in steps)  # a push after every update
    assert all(0 <= m["reward"] <= 1 for m in steps)
    engines = sorted(logs.glob("dare-lmdeploy-*.log"))
    assert len(engines) == nproc  # one engine process per rank
    assert all("serving" in log.read_text() for log in engines)
