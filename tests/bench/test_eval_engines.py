"""bench/eval_engines.py: its --tiny run on CPU (a tiny SDAR trained by the real stages, native rows that
score the folder's held-out problems, lmdeploy rows that say why they did not run), and the pure
pieces the GPU run's verdict comes from (agreement and score difference per sampler)."""
import json
import re
import subprocess
import sys

import pytest

from pipeline_helpers import REPO, worker_env

sys.path.insert(0, str(REPO / "bench"))
from eval_engines_report import compare, verdict  # noqa: E402


def _row(engine: str, sampler: str, scores: list, texts: list) -> dict:
    return {"engine": engine, "sampler": sampler, "items": len(scores), "scores": scores, "predictions": texts,
            "accuracy": sum(scores) / len(scores), "correct": sum(scores)}


def _pair(sampler: str, native: list, lmdeploy: list) -> list[dict]:
    """Both engines' rows; lmdeploy answers as native did where they score alike, "x" elsewhere."""
    answers = [str(i) for i in range(len(native))]
    return [_row("native", sampler, native, answers),
            _row("lmdeploy", sampler, lmdeploy, [a if s == n else "x" for a, s, n in zip(answers, lmdeploy, native)])]


def test_compare_counts_identical_answers_and_discordant_items():
    # one item right only under each engine: the same accuracy, two answers differing
    rows = [_row("native", "static", [1, 1, 0, 1], ["1", "2", "x", "4"]),
            _row("lmdeploy", "static", [1, 0, 1, 1], [" 1", "y", "3", "4\n"])]  # answers compared stripped
    (c,) = compare(rows, 0.01)
    assert c["items"] == 4 and c["different_answers"] == 2 and c["agreement"] == pytest.approx(0.5)
    assert c["only_native_right"] == 1 and c["only_lmdeploy_right"] == 1 and c["difference"] == 0 and c["same_score"]
    assert verdict(rows, [c], 0.01)["verdict"] == "same"
    with pytest.raises(ValueError, match="4 native and 3 lmdeploy items"):
        compare([rows[0], _row("lmdeploy", "static", [1, 1, 1], ["1", "2", "3"])], 0.01)


def test_verdict_is_different_beyond_the_tolerance_and_not_measured_without_pairs():
    rows = _pair("static", [1, 1, 1, 1], [1, 1, 1, 0]) + _pair("threshold", [1, 1, 1, 1], [1, 1, 1, 1])
    decided = verdict(rows, compare(rows, 0.1), 0.1)
    assert decided["verdict"] == "different" and "for static;" in decided["reason"] and "-25.0%" in decided["reason"]
    assert verdict(rows, compare(rows, 0.25), 0.25)["verdict"] == "same"  # 1 of 4 is within 25 %

    failed = rows[:1] + [{"engine": "lmdeploy", "sampler": "static", "items": 4, "error": "RuntimeError: no CUDA GPU here"}]
    decided = verdict(failed, compare(failed, 0.01), 0.01)
    assert decided["verdict"] == "not measured" and "RuntimeError: no CUDA GPU here" in decided["reason"]
    # a sampler one engine could not run leaves the verdict open, even where the others agree
    partial = _pair("static", [1, 1], [1, 1]) + [{"engine": "native", "sampler": "threshold", "items": 2, "error": "E: x"}]
    decided = verdict(partial, compare(partial, 0.01), 0.01)
    assert decided["verdict"] == "not measured" and "threshold was not measured" in decided["reason"]


def test_tiny_run_trains_a_folder_and_scores_it_with_native(tmp_path):
    folder, out = tmp_path / "tiny-sdar", tmp_path / "results" / "eval_engines.md"
    cmd = [sys.executable, str(REPO / "bench" / "eval_engines.py"), "--tiny", "--train", str(folder), "--workdir",
           str(tmp_path / "work"), "--model", str(folder), "--out", str(out)]
    r = subprocess.run(cmd, env={**worker_env(), "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    # the folder: the SFT stage's export, with the char tokenizer's own mask id, its held-out split and how it was made
    from dare_core.models.tokenizer import load_tokenizer

    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["block_size"] == 4 and config["vocab_size"] < 200
    assert config["mask_token_id"] == load_tokenizer(folder).mask_token_id  # not SDAR's released 151669
    assert list(folder.glob("*.safetensors")) and (folder / "tokenizer.json").exists()
    assert not (folder / ".dare-output").exists()  # no stage owns this copy
    training = json.loads((folder / "training.json").read_text())
    assert training["sft_steps"] == 5 and set(training["stage_seconds"]) == {"prepare", "sft"}
    assert training["eval_items"] == 40 and training["size_bytes"] > 0

    text = out.read_text()
    assert re.search(r"^Git commit: \S+", text, re.M) and re.search(r"^Hardware: .+", text, re.M)
    assert re.search(r"^Command: `python3 bench/eval_engines.py --tiny .*`", text, re.M)
    assert "Status: finished" in text and "Same scores: |lmdeploy accuracy - native accuracy| <= 1.0%" in text
    rows_md, agreement_md, verdict_md = (text.split(h, 1)[1] for h in ("## Rows", "## Agreement", "## Verdict"))
    cells = [line.strip("|").split("|") for line in rows_md.split("## Agreement")[0].splitlines() if line.startswith("| ")][1:]
    native = [c for c in cells if c[0].strip() == "native"]
    assert sorted(c[1].split()[0] for c in native) == ["static", "threshold"]
    for c in native:
        assert int(c[2]) == 16 and 0 <= float(c[3]) <= 1 and float(c[5]) > 0 and c[7].strip() == ""
    lmdeploy = [c for c in cells if c[0].strip() == "lmdeploy"]
    assert sorted(c[1].split()[0] for c in lmdeploy) == ["static", "threshold"]
    for c in lmdeploy:  # why it did not run, as `type: message`
        assert c[3].strip() == "" and re.fullmatch(r" \w+: .+ ", c[7])
    assert "No sampler was measured by both engines." in agreement_md and "**not measured**" in verdict_md
    assert "Traceback (most recent call last)" in out.with_suffix(".log").read_text()

    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["verdict"]["verdict"] == "not measured" and saved["training"]["sft_steps"] == 5
    for row in saved["rows"]:
        if row["engine"] == "native":
            assert len(row["predictions"]) == row["items"] == 16 and row["correct"] == sum(row["scores"])
            assert row["settings"]["cache"] == "block_kv" and row["settings"]["block_length"] == 4
        else:
            assert "error" in row and "predictions" not in row

    # what the script decoded is what EvalModel decodes on its own (the eval stage's class)
    from dare_core.eval.configs import get_benchmark
    from dare_core.eval.lm import EvalModel

    static = next(row for row in saved["rows"] if row["engine"] == "native" and row["sampler"] == "static")
    items = get_benchmark("task").load(folder, max_samples=4)
    lm = EvalModel(folder, sampler=static["settings"], chat=False, dtype="float32", device="cpu")
    assert lm.generate([item["question"] for item in items]) == static["predictions"][:4]
