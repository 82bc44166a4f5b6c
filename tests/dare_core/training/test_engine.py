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


_ACCUMULATION = r"""
import sys
import torch
from conftest import make_tiny_llada
from dare_core.config import LaunchConfig, OptimConfig
from dare_core.training import engine as eng

# a wide MLP: its weights are above ZeRO-3's persistence threshold, so they are partitioned
model = make_tiny_llada(mlp_hidden_size=3200).train()
# eps = 1 and no clipping: the step follows the gradient's scale (Adam's first step is otherwise ~sign(g))
optim = OptimConfig(lr=1e-2, eps=1.0, max_grad_norm=0.0, weight_decay=0.0)
engine = eng.build_engine(model, optim, 10, 1, 2, LaunchConfig(zero_stage=int(sys.argv[1])))
ids = torch.arange(48).view(3, 16) % 38
for micro in range(2):  # as the loops do: the module called directly, two backwards a micro-batch (row chunks)
    for row in (micro, 2):
        eng.backward_global(engine, engine.module(ids[row:row + 1]).float().pow(2).mean() * (row + 1))
    engine.step()
with eng.whole_weights(engine):
    torch.save({k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}, sys.argv[2])
"""


def test_zero3_accumulates_every_backward_of_a_step_as_zero0_does(tmp_path):
    """A step of two micro-batches, each with two backwards (the loops' row chunks), with the module
    called directly (not DeepSpeed's forward): ZeRO-3 (partitioned weights) sums every backward's
    gradient into the step, as ZeRO-0 does, instead of keeping the last one's."""
    import subprocess
    import sys
    from pathlib import Path

    from pipeline_helpers import worker_env

    weights = {}
    for zero in (0, 3):
        out = tmp_path / f"z{zero}.pt"
        r = subprocess.run([sys.executable, "-c", _ACCUMULATION, str(zero), str(out)], cwd=Path(__file__).parents[2],
                           env=worker_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        weights[zero] = torch.load(out)
    moved = max((weights[0][k] - weights[3][k]).abs().max().item() for k in weights[0])
    assert moved < 1e-6, moved
