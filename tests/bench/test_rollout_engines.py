"""bench/rollout_engines.py: its --tiny run on CPU (real native rows, lmdeploy rows that say why they did
not run, a verdict keeping native), and the pure pieces the GPU run's lmdeploy rows go through
(greedy agreement, the verdict from measured pairs)."""
import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

from pipeline_helpers import REPO, worker_env

sys.path.insert(0, str(REPO / "bench"))
from rollout_engines import agreement, verdict  # noqa: E402


def test_agreement_counts_positions_and_whole_rows():
    a = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    b = torch.tensor([[1, 2, 3, 4], [5, 0, 7, 0], [9, 9, 9, 1]])
    tokens, rows = agreement(a, b)
    assert tokens == pytest.approx(9 / 12) and rows == pytest.approx(1 / 3)
    assert agreement(a, a) == (1.0, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        agreement(a, b[:, :3])


def _pair(tps_native: float, tps_lmdeploy: float, agree: float, gen: int = 256) -> list[dict]:
    base = {"unmasking": "static", "gen": gen, "batch": 32}
    return [dict(base, engine="native", tokens_per_s=tps_native),
            dict(base, engine="lmdeploy", tokens_per_s=tps_lmdeploy, token_agreement=agree)]


def test_verdict_weighs_speed_and_agreement():
    # lmdeploy 2x and 4x as fast: geometric mean sqrt(8) = 2.83x
    decided, lines = verdict(_pair(100, 200, 0.95) + _pair(100, 400, 0.97, gen=1024), 0.9, None)
    assert decided["default"] == "lmdeploy" and "2.83x as fast" in decided["reason"] and "96.0%" in decided["reason"]
    assert any("| 2.00x | lmdeploy |" in line for line in lines)
    decided, _ = verdict(_pair(100, 200, 0.5), 0.9, None)  # faster, but decodes other tokens
    assert decided["default"] == "native" and "only 50.0%" in decided["reason"]
    decided, _ = verdict(_pair(300, 100, 1.0), 0.9, None)
    assert decided["default"] == "native" and "native is 3.00x as fast" in decided["reason"]


def test_tiny_run_measures_native_and_says_why_lmdeploy_did_not_run(tmp_path, monkeypatch):
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
    verdict_text = text.split("## Verdict", 1)[1]
    assert "**native** (unchanged)" in verdict_text and "lmdeploy was not measured" in verdict_text
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["verdict"]["default"] == "native" and len(saved["rows"]) == 2 * len(grid)
    assert all(row["tokens_per_s"] > 0 for row in saved["rows"] if row["engine"] == "native")
    assert all("error" in row for row in saved["rows"] if row["engine"] == "lmdeploy")

    # the folder as the engine serves it to lmdeploy: its config and tokenizer read without remote code
    folder = next((tmp_path / "work" / "models").glob("sdar-tiny-*"))
    transformers = pytest.importorskip("transformers")
    from dare_core.sampling.engines.lmdeploy import served_folder

    view = served_folder(folder, tmp_path / "view")
    hf_config = transformers.PretrainedConfig.from_pretrained(view)  # lmdeploy's fallback where AutoConfig fails
    assert hf_config.architectures == ["SDARForCausalLM"] and hf_config.block_size == 4 and hf_config.mask_token_id == 251
    assert transformers.AutoTokenizer.from_pretrained(view, trust_remote_code=True).eos_token is not None

    # the lmdeploy child's own code, on CPU: our loop behind the engine's interface decodes what native did
    class NativeBehindEngine:
        def __init__(self, model, model_path, **options):
            from dare_core.models.hf_folder import load_model

            self.options, self._engine = options, object()
            self.model = load_model(model_path, dtype=torch.float32).eval()  # as the native rows ran on CPU

        def generate(self, prompts, params):
            from dare_core.sampling.decode import generate

            return generate(self.model, prompts, dataclasses.replace(params, cuda_graphs=None))  # no CUDA here

        def close(self):
            pass

    import dare_core.sampling.engines as engines
    from rollout_engines import lmdeploy_child
    from stamp import jsonl_rows

    work = tmp_path / "work"
    spec = {"folder": str(folder), "unmasking": "static", "points": [[8, 1], [16, 2]],
            "rows": str(work / "child.jsonl"), "tokens": str(work / "native_tokens.pt"), "threshold": 0.9, "prompt": 8,
            "repeats": 1, "deadline": None, "backend": "ray", "cache_max_entry_count": 0.5}
    (work / "spec.json").write_text(json.dumps(spec))
    started = []
    monkeypatch.setattr(engines, "build_engine", lambda name, model, **kw: started.append((name, kw)) or NativeBehindEngine(model, **kw))
    assert lmdeploy_child(work / "spec.json") == 0
    (name, options), = started
    assert name == "lmdeploy" and options["model_path"] == spec["folder"] and options["max_batch_size"] == 2
    assert options["distributed_executor_backend"] == "ray" and options["cache_max_entry_count"] == 0.5
    rows = jsonl_rows(work / "child.jsonl")
    assert [(r["engine"], r["gen"], r["batch"], r["steps"]) for r in rows] == [("lmdeploy", 8, 1, 8), ("lmdeploy", 16, 2, 16)]
    assert all(r["token_agreement"] == r["row_agreement"] == 1.0 and r["ms_per_step"] > 0 for r in rows)

    class NeverStarts(NativeBehindEngine):
        def __init__(self, model, model_path, **options):
            self._engine = None

        def generate(self, prompts, params):
            raise RuntimeError("no GPU for you")

    spec["rows"] = str(work / "failed.jsonl")
    (work / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setattr(engines, "build_engine", lambda name, model, **kw: NeverStarts(model, **kw))
    lmdeploy_child(work / "spec.json")
    first, second = jsonl_rows(work / "failed.jsonl")
    assert first["error"] == "RuntimeError: no GPU for you" and second["error"].startswith("not run: the engine did not start")
