"""bench/long_generation.py --tiny runs the real RL stage loop with configs/long_generation.yaml applied
(its two-layer model, shorter responses set on the command line) and writes a results file whose
rows are the loop's own logged steps, with the settings the stage read. It is also the test that
the preset loads and trains: its sampler, LoRA, packing and logits-free settings as written."""
import json
import re
import subprocess
import sys

from pipeline_helpers import REPO, worker_env


def test_tiny_run_writes_a_row_per_step(tmp_path):
    out = tmp_path / "long_generation.md"
    sets = ["rl.prompts_per_step=2", "rl.group_size=4", "rl.sampler.gen_length=64", "rl.sampler.steps=64",
            "rl.micro_batch_size=4", "rl.sampler.batch_size=8", "model.logits_chunk=32"]
    cmd = [sys.executable, str(REPO / "bench" / "long_generation.py"), "--tiny", "--workdir", str(tmp_path / "work"),
           "--out", str(out), "--set", *sets]
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert re.search(r"^Command: `python3 bench/long_generation.py --tiny .*`", text, re.M)
    # the preset's own values where --set left them, the --set ones elsewhere
    assert "Preset: `configs/long_generation.yaml`" in text
    assert "gen 64 (block 4" in text and "unmasking dynamic 0.85" in text and "cache block_kv" in text
    assert "LoRA r 128" in text and "gradient checkpointing on" in text and "logits_chunk 32" in text
    assert "Status: finished." in text
    rows = [line.strip("|").split("|") for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(row[0]) for row in rows] == [1, 2]
    for row in rows:
        phases, step_s = [float(c) for c in row[1:6]], float(row[6])
        assert phases[0] > 0 and phases[3] > 0 and sum(phases) <= step_s + 0.15  # (cells rounded to 0.1 s)
        assert float(row[7]) > 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert [m["step"] for m in saved["runs"][0]["steps"]] == [1, 2] and saved["settings"]["set"] == sets


def test_tiny_llada_preset_on_two_ranks(tmp_path):
    """The masked-diffusion preset picks the LLaDA shape from the config it resolves (the family is
    the preset's, over the 4k one it extends), and launch.nproc=2 starts two ranks with torchrun."""
    out = tmp_path / "long_generation_llada.md"
    sets = ["launch.nproc=2", "rl.num_steps=1", "rl.prompts_per_step=2", "rl.group_size=4", "rl.sampler.gen_length=64",
            "rl.sampler.steps=32", "rl.micro_batch_size=2", "rl.sampler.batch_size=4", "model.logits_chunk=32"]
    cmd = [sys.executable, str(REPO / "bench" / "long_generation.py"), "--tiny", "--preset",
           str(REPO / "configs" / "long_generation_llada.yaml"), "--workdir", str(tmp_path / "work"), "--out", str(out),
           "--set", *sets]
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert (tmp_path / "work" / "models" / "llada-tiny" / "config.json").exists()
    assert "gen 64 (block 32" in text and "cache dual" in text and "2 rank(s)" in text
    assert "2 ranks (one a GPU, started by torchrun)" in text and "Status: finished." in text
    rows = [line.strip("|").split("|") for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(row[0]) for row in rows] == [1] and float(rows[0][1]) > 0


def test_stopped_responses_are_scored_without_the_canvas_after_their_stop(tmp_path):
    """--stop-tokens ends random-weight responses early; --canvas both runs the stage twice: the same
    rollouts (same seeds) are scored over fewer tokens than over the whole canvas."""
    sets = ["rl.num_steps=1", "rl.prompts_per_step=2", "rl.group_size=4", "rl.sampler.gen_length=64", "rl.sampler.steps=64",
            "rl.micro_batch_size=4", "rl.sampler.batch_size=8", "model.logits_chunk=32"]
    out = tmp_path / "stops.md"
    cmd = [sys.executable, str(REPO / "bench" / "long_generation.py"), "--tiny", "--workdir", str(tmp_path / "work"),
           "--out", str(out), "--stop-tokens", "12", "--canvas", "both", "--set", *sets]
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "12 token ids made stop tokens" in text and "## Canvas: trim" in text and "## Canvas: keep" in text
    trim, keep = [line.strip("|").split("|") for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    response, scored = (float(trim[7]), float(keep[7])), (float(trim[9]), float(keep[9]))
    assert float(trim[8]) == float(keep[8]) > 0  # the same rollouts took the same denoising steps
    assert response[0] == response[1] < 60, (response, scored)  # the same rollouts, ended early
    assert scored[0] < scored[1] - 4, (response, scored)
