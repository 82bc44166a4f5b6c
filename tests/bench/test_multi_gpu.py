"""bench/multi_gpu.py's arithmetic, without a run: the batch split that keeps the 1-GPU global batch,
the per-GPU scaling efficiency and the phase a shortfall is charged to. (Its runs, at the 8B
shapes, need GPUs; `--tiny` is its CPU smoke run.)"""
import sys

import pytest

from pipeline_helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import multi_gpu  # noqa: E402
import train_step  # noqa: E402


@pytest.mark.parametrize("gpus", [1, 2, 4, 8, 32])
def test_every_gpu_count_trains_the_one_gpu_global_batch(gpus):
    s = train_step.Settings()
    split = multi_gpu.split_batch(s, gpus)
    assert split["sft.micro_batch_size"] * split["sft.grad_accum"] * gpus == s.sft_micro * s.sft_accum
    assert split["sft.micro_batch_size"] <= s.sft_micro


def _rl(gpus: int, step: float, **phases) -> dict:
    row = {"part": "rl-lora", "name": f"rl-{gpus}", "gpus": gpus, "step_s": step, "other": 0.0, "zero": phases.pop("zero", 0),
           "offload": "none"}
    row.update({p: phases.get(p, 0.0) for p in train_step.RL_PHASES})
    return row


def test_scaling_names_the_phase_that_loses_efficiency():
    one = _rl(1, 50.0, rollout=30.0, forward_backward=20.0)
    # rollouts scale perfectly (15 s on each of 2 GPUs); the update does not (15 s instead of 10)
    two = _rl(2, 30.0, rollout=15.0, forward_backward=15.0)
    lines = multi_gpu.scaling_lines([one, two])
    row = next(line for line in lines if line.startswith("| rl-lora | 0 | 2 |"))
    assert "83.3%" in row and "| short |" in row  # 50 / (2 x 30)
    assert row.split("| ")[-1].startswith("forward_backward: 20.00 / 30.00")
    # and why: the one losing phase's mechanism under the run's ZeRO stage, and no line for a phase that scaled
    why = [line for line in lines if line.startswith("- rl-lora (ZeRO-0) on 2 GPUs")]
    assert len(why) == 1 and why[0].startswith("- rl-lora (ZeRO-0) on 2 GPUs, forward_backward:") and "all-reduced" in why[0]
    one_zero3 = _rl(1, 50.0, rollout=30.0, forward_backward=20.0, zero=3)
    zero3 = multi_gpu.scaling_lines([one, one_zero3, _rl(2, 30.0, rollout=15.0, forward_backward=15.0, zero=3)])
    assert "reduce-scattered" in next(line for line in zero3 if line.startswith("- rl-lora (ZeRO-3) on 2 GPUs"))
    # a run is paired with the 1-GPU run of its own ZeRO stage only
    assert not any(line.startswith("- rl-lora (ZeRO-0) on 2 GPUs") for line in zero3)
    assert "| meets it |" in multi_gpu.scaling_lines([one, _rl(2, 26.0, rollout=15.0, forward_backward=11.0)])[-2]


def test_render_lays_out_measured_rows_again_and_says_by_which_commit(tmp_path, monkeypatch):
    s = train_step.Settings()
    run = {"commit": "a" * 40, "command": "python3 bench/multi_gpu.py", "hardware": "2 GPUs", "date": "then",
           "settings": __import__("dataclasses").asdict(s)}
    rows = [_rl(1, 50.0, rollout=30.0, forward_backward=20.0), _rl(2, 30.0, rollout=15.0, forward_backward=15.0)]
    for r in rows:
        r.update(unmasking="topk", peak_gib=1.0, rewards=[0.5], noise_lines=0)
    (tmp_path / "multi_gpu.json").write_text(__import__("json").dumps({"runs": [run], "rows": rows}))
    monkeypatch.setenv("DARE_COMMIT", "b" * 40)
    assert multi_gpu.main(["--render", "--out", str(tmp_path / "multi_gpu.md")]) == 0
    text = (tmp_path / "multi_gpu.md").read_text()
    assert "a" * 40 in text and f"Laid out by commit {'b' * 40}" in text and "- rl-lora (ZeRO-0) on 2 GPUs, forward_backward:" in text
