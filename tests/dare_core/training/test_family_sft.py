"""The SFT stage trains a tiny Dream, SDAR, LLaDA2 or DiffusionGemma model selected by config alone
(block families through the two-stream loss, DiffusionGemma through the uniform-noise loss), and
exports a checkpoint of that family."""
import json
import subprocess

import pytest

from dare_core.config import load_config
from dare_core.data.prepare import prepare
from pipeline_helpers import dare, tiny_params, worker_env, write_params

INITS = {
    "Dream": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 64, "max_position_embeddings": 24},
    "sdar": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "intermediate_size": 64, "max_position_embeddings": 24, "block_size": 4},
    "llada2_moe": {"hidden_size": 32, "head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
                   "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                   "topk_group": 1, "max_position_embeddings": 24},
    # uniform noise: the SFT stage takes its own objective (algorithms/uniform_sft.py)
    "diffusion_gemma": {"hidden_size": 32, "num_experts": 4, "max_position_embeddings": 24, "canvas_length": 4},
}


@pytest.mark.parametrize("family", list(INITS))
def test_sft_stage_trains_each_family(tmp_path, family):
    over = {"model__family": family, "model__init": INITS[family], "sft__max_steps": 30, "sft__log_every": 5}
    params = write_params(tmp_path / "params.yaml", tiny_params(tmp_path, **over))
    prepare(load_config(params))
    r = subprocess.run(dare("stage", "sft", "--params", str(params)), env=worker_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "runs" / "t" / "sft"
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == family
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(l == l and l < 50 for l in losses) and losses[-1] < losses[0]


def test_lora_sft_rl_convert(tmp_path):
    """LoRA end to end: adapters train in SFT and RL (reference = adapter disabled, KL on), and
    the exported folders carry merged weights that load as a plain checkpoint."""
    over = {"model__lora": {"r": 4, "alpha": 8}, "sft__max_steps": 10, "rl__kl_beta": 0.05, "rl__num_steps": 2}
    params = write_params(tmp_path / "params.yaml", tiny_params(tmp_path, **over))
    prepare(load_config(params))
    for stage in ("sft", "rl", "convert"):
        r = subprocess.run(dare("stage", stage, "--params", str(params)), env=worker_env(), capture_output=True, text=True)
        assert r.returncode == 0, (stage, r.stderr[-3000:])
    import torch

    from dare_core.models.hf_folder import load_model

    base, sft, rl = (load_model(p) for p in (tmp_path / "runs/t/base", tmp_path / "runs/t/sft/model", tmp_path / "models/t"))
    x = torch.randint(0, 20, (1, 8))
    assert not torch.equal(base(x), sft(x))  # the trained adapter is folded into the exported weights
    assert rl(x).shape == sft(x).shape
    rl_metrics = [json.loads(line) for line in (tmp_path / "runs/t/rl/metrics.jsonl").read_text().splitlines()]
    train = [m for m in rl_metrics if m["step"] > 0]  # step 0: validation of the SFT model only
    assert len(train) == 2 and all("kl" in m for m in train)  # reference = adapter disabled
