"""Results files written by bench scripts: each run keeps its own stamp, ratios stay inside a run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dare_core.models.tokenizer import char_tokenizer
from eval_helpers import tiny_folder

REPO = Path(__file__).resolve().parents[2]


def eval_row(setting: str, wall: float, commit: str) -> dict:
    return {"setting": setting, "wall_s": wall, "tokens_per_s": 64 * 256 / wall, "prompts": 64, "batch_size": 64,
            "prompt_tokens_mean": 171.0, "hardware": "GPU X", "commit": commit, "libraries": "torch 9"}


def test_eval_report_gives_each_run_its_own_section_and_ratio(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([eval_row("none", 200.0, "aaa1111"), eval_row("dual+graph", 40.0, "aaa1111")]))
    b.write_text(json.dumps([eval_row("dual+graph", 10.0, "bbb2222")]))  # no baseline in this run
    out = subprocess.run([sys.executable, str(REPO / "bench" / "eval_gpu.py"), "--report", str(a), str(b)],
                         capture_output=True, text=True, check=True).stdout
    run0, run1 = out.split("## Run 0")[1].split("## Run 1")
    assert "Git commit: aaa1111" in run0 and "| dual+graph | 40.0 | 410 | 5.00x |" in run0
    assert "--settings none,dual+graph --n 64 --batch-size 64" in run0  # rebuilt for rows without a command
    # a ratio across runs (200 / 10 = 20x) would be a number no single run measured
    assert "Git commit: bbb2222" in run1 and "| dual+graph | 10.0 | 1638 |  |" in run1 and "20.00x" not in out


def test_threshold_table_covers_every_model_in_one_stamped_file(tmp_path):
    tok = char_tokenizer()
    rows = [{"prompt": f"{i}+{i}=", "prompt_text": tok.apply_chat_template([{"role": "user", "content": f"{i}+{i}="}]),
             "ground_truth": str(2 * i), "task": "arithmetic", "uid": f"e{i}"} for i in range(4)]
    data = tmp_path / "eval.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    models = [str(tiny_folder(tmp_path, "llada", seed)) for seed in (0, 1)]
    out = tmp_path / "threshold.md"
    subprocess.run([sys.executable, str(REPO / "bench" / "rollout.py"), "threshold", "--model", *models, "--data", str(data),
                    "--gen-length", "4", "--taus", "0.9", "--out", str(out)], check=True, capture_output=True, text=True)
    text = out.read_text()
    assert text.startswith("# Threshold decoding on a trained model") and "Git commit: " in text and "Libraries: " in text
    for model in models:
        table = text.split(f"### `{model}`")[1].split("###")[0]
        assert "| plain (1 token/step) |" in table and "| 1.0x |" in table
        assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + 4  # header + 4 settings


def test_speed_smoke_times_every_mode_of_both_families(tmp_path):
    """`rollout.py speed --smoke` (two small layers on CPU, the real configs' ids moved inside the
    small vocabulary) writes a row per CPU mode of each config, each against its model's `none` row."""
    out = tmp_path / "speed.md"
    subprocess.run([sys.executable, str(REPO / "bench" / "rollout.py"), "speed", "--smoke", "--gen", "64", "--batch", "1",
                    "--prompt", "8", "--steps", "4", "--out", str(out)], check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith(("| LLaDA", "| SDAR"))]
    assert [(r[0], r[3]) for r in rows] == [("LLaDA-8B-Instruct", m) for m in ("reference", "none", "prefix", "dual eager")] + \
        [("SDAR-8B-Chat", m) for m in ("none", "block_kv eager")]
    assert all(float(r[5]) > 0 for r in rows) and [r[7] for r in rows if r[3] == "none"] == ["1.00x", "1.00x"]


def test_a_commit_named_by_hand_must_be_a_whole_hash(monkeypatch):
    import importlib

    import pytest

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    stamp = importlib.import_module("stamp")

    monkeypatch.setenv("DARE_COMMIT", "ff06b86e")
    with pytest.raises(SystemExit, match="whole hash"):
        stamp.git_commit()
    monkeypatch.setenv("DARE_COMMIT", "ff06b86c728df7cea065a12d4243177114a544f5")
    assert stamp.git_commit() == "ff06b86c728df7cea065a12d4243177114a544f5"
