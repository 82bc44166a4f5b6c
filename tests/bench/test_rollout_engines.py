"""bench/rollout_engines.py: its --tiny run on CPU (real native rows, lmdeploy rows that say why they did
not run, a verdict keeping native), and the pure pieces the GPU run's lmdeploy rows go through
(greedy agreement, the verdict from measured pairs and parity, the parity table)."""
import json
import re
import subprocess
import sys

import pytest
import torch

from pipeline_helpers import REPO, worker_env

sys.path.insert(0, str(REPO / "bench"))
from rollout_engines import agreement, first_difference, parity_lines, verdict, with_agreement  # noqa: E402


def test_agreement_counts_positions_and_whole_rows():
    a = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    b = torch.tensor([[1, 2, 3, 4], [5, 0, 7, 0], [9, 9, 9, 1]])
    tokens, rows = agreement(a, b)
    assert tokens == pytest.approx(9 / 12) and rows == pytest.approx(1 / 3)
    assert agreement(a, a) == (1.0, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        agreement(a, b[:, :3])


def _pair(tps_native: float, tps_lmdeploy: float, gen: int = 256) -> list[dict]:
    base = {"unmasking": "static", "gen": gen, "batch": 32}
    return [dict(base, engine="native", tokens_per_s=tps_native),
            dict(base, engine="lmdeploy", tokens_per_s=tps_lmdeploy, token_agreement=0.02)]


def _parity(clear: float, weights: str = "random, std 0.3") -> dict:
    return {"engine": "lmdeploy", "kind": "parity", "weights": weights, "gen": 32, "prompts": 4, "forwards": 100, "rows": 400,
            "max_abs_err": 0.5, "max_err_over_std": 0.02, "argmax_agreement": 0.97, "argmax_agreement_clear": clear,
            "clear_rows": 300, "median_top2_gap": 2.0, "greedy_token_agreement": 0.1, "greedy_row_agreement": 0.0,
            "first_difference": [3, None, 5, 9]}


def test_first_difference():
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert first_difference(a, torch.tensor([[1, 0, 3], [4, 5, 6]])) == [1, None]


def test_verdict_weighs_speed_and_teacher_forced_parity():
    # lmdeploy 2x and 4x as fast: geometric mean sqrt(8) = 2.83x; greedy trajectories may part at near ties
    decided, lines = verdict(_pair(100, 200) + _pair(100, 400, gen=1024) + [_parity(0.999)], 0.99, None)
    assert decided["default"] == "lmdeploy" and "2.83x as fast" in decided["reason"] and "99.90%" in decided["reason"]
    assert any("| 2.00x | lmdeploy |" in line for line in lines)
    decided, _ = verdict(_pair(100, 200) + [_parity(0.9)], 0.99, None)  # faster, but another model
    assert decided["default"] == "native" and "only 90.00%" in decided["reason"]
    decided, _ = verdict(_pair(100, 200), 0.99, None)
    assert decided["default"] == "native" and "parity was not measured" in decided["reason"]
    decided, _ = verdict(_pair(300, 100) + [_parity(1.0)], 0.99, None)
    assert decided["default"] == "native" and "native is 3.00x as fast" in decided["reason"]
    # the grid's weights decide: the first parity row
    decided, _ = verdict(_pair(100, 200) + [_parity(0.5), _parity(1.0, "trained")], 0.99, None)
    assert decided["default"] == "native"


def test_parity_table_and_agreement_from_tokens():
    lines = parity_lines([_parity(0.999), {"engine": "lmdeploy", "kind": "parity", "weights": "x", "error": "Boom: no"}])
    assert len(lines) == 4 and "| 99.90% of 300 |" in lines[2] and "| 5 of 32 |" in lines[2] and lines[3].endswith("Boom: no |")
    rows = [{"engine": "lmdeploy", "unmasking": "static", "gen": 2, "batch": 2, "tokens_per_s": 1.0},
            {"engine": "native", "unmasking": "static", "gen": 2, "batch": 2, "tokens_per_s": 1.0}]
    tokens = {"native": {"static-2-2": torch.tensor([[1, 2], [3, 4]])}, "lmdeploy": {"static-2-2": torch.tensor([[1, 2], [3, 0]])}}
    out = with_agreement(rows, tokens)
    assert out[0]["token_agreement"] == 0.75 and out[0]["row_agreement"] == 0.5 and "token_agreement" not in out[1]
    assert "token_agreement" not in with_agreement(rows, {"native": {}, "lmdeploy": tokens["lmdeploy"]})[0]


def test_tiny_run_measures_native_and_says_why_lmdeploy_did_not_run(tmp_path):
    out = tmp_path / "rollout_engines.md"
    cmd = [sys.executable, str(REPO / "bench" / "rollout_engines.py"), "--tiny", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    r = subprocess.run(cmd, env={**worker_env(), "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert re.search(r"^Git commit: \S+", text, re.M) and re.search(r"^Hardware: .+", text, re.M)
    assert re.search(r"^Command: `python3 bench/rollout_engines.py --tiny .*`", text, re.M)
    assert "Status: finished." in text
    grid = {(u, b, g) for u in ("static", "dynamic") for b in (1, 2) for g in (8, 16)}
    cells = [line.strip("|").split("|") for line in text.splitlines() if re.match(r"\| (native|lmdeploy) \|", line)]
    native = [c for c in cells if c[0].strip() == "native"]
    assert {(c[1].split()[0], int(c[2]), int(c[3])) for c in native} == grid and len(native) == len(grid)
    for c in native:
        steps, ms, tps, repeat = int(c[5]), float(c[6]), float(c[7].replace(",", "")), float(c[10])
        gen = int(c[3])
        assert gen // 4 <= steps <= gen and ms > 0 and tps > 0  # blocks of 4, 4 steps per block at most
        assert repeat == 1.0  # greedy decoding is deterministic: the timed run equals the warm-up
    lmdeploy = [c for c in cells if c[0].strip() == "lmdeploy"]
    assert {(c[1].split()[0], int(c[2]), int(c[3])) for c in lmdeploy} == grid
    for c in lmdeploy:
        assert c[4].strip() == "" and "not run" in c[-1] and "lmdeploy" in c[-1] and "CUDA" in c[-1]
    assert "## Teacher-forced parity" in text and "(no parity row)" in text
    verdict_text = text.split("## Verdict", 1)[1]
    assert "**native** (unchanged)" in verdict_text and "lmdeploy was not measured" in verdict_text
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["verdict"]["default"] == "native" and len(saved["rows"]) == 2 * len(grid)
    assert all(row["tokens_per_s"] > 0 for row in saved["rows"] if row["engine"] == "native")
    assert all("error" in row for row in saved["rows"] if row["engine"] == "lmdeploy")

    # the folder as the engine serves it to lmdeploy: its config and tokenizer read without remote code
    folder = next((tmp_path / "work" / "models").glob("sdar-tiny-*"))
    transformers = pytest.importorskip("transformers")
    from dare_core.models.hf_folder import inspect_model
    from dare_core.sampling.engines.lmdeploy import served_folder

    model = inspect_model(folder)
    view = served_folder(folder, tmp_path / "view", model.mask_token_id, model.pad_token_id)
    hf_config = transformers.PretrainedConfig.from_pretrained(view)  # lmdeploy's fallback where AutoConfig fails
    assert hf_config.architectures == ["SDARForCausalLM"] and hf_config.block_size == 4 and hf_config.mask_token_id == 251
    assert transformers.AutoTokenizer.from_pretrained(view, trust_remote_code=True).eos_token is not None
