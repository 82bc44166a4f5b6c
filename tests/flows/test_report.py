"""Per-stage reports publish only what the stage wrote in this run."""
from __future__ import annotations

import json
import os
import time

from flows.report import stage_markdown


def test_a_report_holds_only_files_written_since_the_stage_started(tmp_path):
    (tmp_path / "params.yaml").write_text("run:\n  name: t\n  runs_dir: out\n  metrics_dir: m\n")
    (tmp_path / "m").mkdir()
    (tmp_path / "out" / "t" / "sft").mkdir(parents=True)
    metrics, png = tmp_path / "m" / "sft.json", tmp_path / "out" / "t" / "sft" / "loss.png"
    metrics.write_text(json.dumps({"final_loss": 1.5, "sched": {"lr": 0.001}}))
    png.write_bytes(b"\x89PNG fake")
    old = time.time() - 3600
    for p in (metrics, png):
        os.utime(p, (old, old))
    assert stage_markdown("sft", tmp_path, since=time.time()) is None  # an earlier run's files

    png.write_bytes(b"\x89PNG new")
    report = stage_markdown("sft", tmp_path, since=time.time() - 5)
    assert "final_loss" not in report  # metrics.json is still the old one
    assert "![loss](data:image/png;base64," in report and "`out/t/sft/loss.png`" in report
    metrics.write_text(json.dumps({"final_loss": 1.25, "sched": {"lr": 0.001}}))
    report = stage_markdown("sft", tmp_path, since=time.time() - 5)
    assert "| final_loss | 1.25 |" in report and "| sched.lr | 0.001 |" in report
