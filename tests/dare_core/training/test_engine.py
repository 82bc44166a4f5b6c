"""`launch.offload_optimizer: cpu` trains like the optimizer on the device: ZeRO with DeepSpeedCPUAdam
stepping the fp32 master weights and Adam's moments in host memory (its C++ op is JIT-built on first
use, about a minute on 2 cores, then cached in TORCH_EXTENSIONS_DIR)."""
import json

import torch
from safetensors.torch import load_file

from bad_input import run


def _losses(stage_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (stage_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _weights(folder) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_an_offloaded_optimizer_trains_like_the_one_on_the_device(project):
    """The project's SFT run (ZeRO-0, torch AdamW, float32, 20 steps) against the same run under
    ZeRO-2 with the optimizer offloaded: the same losses and weights up to float rounding."""
    sft = project / "runs" / "t" / "sft"
    losses, weights = _losses(sft), _weights(sft / "model")
    r = run(project, "stage", "sft", "--restart", "-S", "launch.zero_stage=2", "-S", "launch.offload_optimizer=cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    offloaded = _losses(sft)
    assert len(offloaded) == len(losses) == 4
    assert max(abs(a - b) for a, b in zip(offloaded, losses)) < 1e-5, (offloaded, losses)
    after = _weights(sft / "model")
    assert after.keys() == weights.keys() and max((after[k] - weights[k]).abs().max().item() for k in weights) < 1e-5
    # DeepSpeed's CPU Adam stepped it (torch's AdamW has no bias_correction option)
    state = torch.load(sft / "checkpoints" / "step00000020" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert "bias_correction" in state["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0]
