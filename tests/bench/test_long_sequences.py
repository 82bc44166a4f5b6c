"""bench/long_sequences.py: the summary of a mode's climb, the logits-free comparison, and its CPU
smoke run end to end (one tiny mode)."""
import json
import sys

from pipeline_helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import long_sequences as ls  # noqa: E402


def _climb(*lengths, fails_at=None, speed=1000.0):
    rows = [{"length": n, "step_s": n / speed, "tokens_per_s": speed, "peak_gib": n / 1000} for n in lengths]
    return rows + ([{"length": fails_at, "error": "out of GPU memory"}] if fails_at else [])


def test_summary_keeps_the_longest_length_that_trained_and_why_the_next_failed():
    row = ls.summary_row("llada", "logits", 1, _climb(2048, 4096, fails_at=8192))
    assert (row["longest"], row["peak_gib"], row["next"]) == (4096, 4.096, "8192: out of GPU memory")
    assert ls.summary_row("llada", "logits", 1, [{"length": None, "error": "exit code 1: boom"}])["longest"] is None


def test_comparison_is_the_length_ratio_and_the_speed_at_the_common_length():
    rows = [ls.summary_row("llada", "logits", 1, _climb(2048, 4096, fails_at=8192, speed=1000.0)),
            ls.summary_row("llada", "logits-free", 1, _climb(2048, 4096, 8192, 16384, fails_at=24576, speed=1100.0))]
    (line,) = [x for x in ls.comparison_lines(rows) if x.startswith("- llada")]
    assert "4.00x the longest length" in line and "(16384 against 4096 tokens)" in line and "is 1.10x theirs" in line


def test_tiny_run_writes_the_report(tmp_path):
    out = tmp_path / "long_sequences.md"
    assert ls.main(["--tiny", "--shapes", "sdar", "--modes", "logits-free", "--max-length", "64", "--reps", "1",
                    "--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = data["rows"]
    assert row["longest"] == 64 and row["tokens_per_s"] > 0 and row["next"] is None
    assert "| sdar | logits-free | 1 | at least 64 |" in out.read_text()


def test_parallel_modes_and_add_keep_one_file(tmp_path):
    """Two modes side by side, then a third added by a second invocation: one file with all three
    rows in mode order, and the note that modes ran side by side."""
    out, common = tmp_path / "long_sequences.md", ["--tiny", "--shapes", "llada", "--max-length", "64", "--reps", "1",
                                                    "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "long_sequences.md")]
    assert ls.main(common + ["--modes", "logits", "logits-free", "--parallel"]) == 0
    assert ls.main(common + ["--modes", "sp2", "--add"]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [(r["mode"], r["longest"]) for r in data["rows"]] == [("logits", 64), ("logits-free", 64), ("sp2", 64)]
    assert data["run"]["parallel"] and "; then python3 bench/long_sequences.py" in data["run"]["command"]
    assert "side by side" in out.read_text()
