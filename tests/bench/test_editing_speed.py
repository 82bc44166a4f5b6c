"""bench/editing_speed.py --smoke decodes the shrunk LLaDA2.1-mini layout under the three modes at each
batch and writes a row per (batch, mode) with the mode's thresholds and a speed; on random weights
speed mode's free editing takes more steps a token than decoding without edits."""
import json
import re
import subprocess
import sys

from pipeline_helpers import REPO, worker_env


def test_smoke_run_writes_a_row_per_batch_and_mode(tmp_path):
    out = tmp_path / "editing_speed.md"
    cmd = [sys.executable, str(REPO / "bench" / "editing_speed.py"), "--smoke", "--batch", "1", "3", "--gen", "64",
           "--prompt", "32", "--out", str(out)]
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert re.search(r"^Command: `python3 bench/editing_speed.py --smoke .*`", text, re.M)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if re.match(r"\| \d", line)]
    assert [(row[0], row[1], row[2], row[3]) for row in rows] == [
        (b, m, t, e) for b in ("1", "3") for m, t, e in (("none", "0.7", "none"), ("speed", "0.5", "0.0"), ("quality", "0.7", "0.5"))]
    assert all(float(row[4]) > 0 for row in rows)
    found = {(row["batch"], row["mode"]): row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    # prompts of whole blocks: without edits one step a token (random weights commit the floor's one)
    assert found[(1, "none")]["steps_per_token"] <= 1.0 < found[(1, "speed")]["steps_per_token"]
