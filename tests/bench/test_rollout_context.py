"""bench/rollout_context.py --smoke decodes both shapes' small versions at two contexts and writes a
row per (model, context, batch) with a step time, through the sampler the rollouts use."""
import re
import subprocess
import sys

from pipeline_helpers import REPO, worker_env


def test_smoke_run_writes_a_row_per_context(tmp_path):
    out = tmp_path / "rollout_context.md"
    cmd = [sys.executable, str(REPO / "bench" / "rollout_context.py"), "--smoke", "--contexts", "64", "128", "--batch", "2",
           "--llada-contexts", "64", "128", "--sdar-blocks", "2", "--out", str(out)]
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert re.search(r"^Command: `python3 bench/rollout_context.py --smoke .*`", text, re.M)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if re.match(r"\| (SDAR|LLaDA)", line)]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("SDAR-8B-Chat", "block_kv", "64"), ("SDAR-8B-Chat", "block_kv", "128"),
        ("LLaDA-8B-Instruct", "dual", "64"), ("LLaDA-8B-Instruct", "dual", "128")]
    # a step time for each (on 2 busy cores a smoke run's difference of two timings can be anything)
    assert all(row[4] and float(row[4]) == float(row[4]) for row in rows)
