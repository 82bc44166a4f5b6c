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
    assert [m["step"] for m in saved["steps"]] == [1, 2] and saved["settings"]["set"] == sets
