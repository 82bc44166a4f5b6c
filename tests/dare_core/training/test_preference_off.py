"""A dataset with no preference pairs turns the preference stage off (`preference.enabled: auto`):
it says why once, and leaves every output dvc.yaml declares; `true` makes the missing pairs an
error before anything is written; eval refuses to score an off stage's model."""
from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest

from dare_core.config import load_config
from dare_core.data.prepare import prepare
from dare_core.data.schema import DataError
from dare_core.errors import UserError
from dare_core.ownership import STAGE_OFF_NOTE
from dare_core.training.preference_loop import run_preference
from dare_core.workers.eval import run_eval
from pipeline_helpers import tiny_params, write_params


def reversed_words(n: int) -> list[dict]:
    """String answers without a digit: no preference pair can be derived from them."""
    words = ["".join(chr(97 + (i * 7919 + 13) // 26 ** k % 26) for k in range(4)) for i in range(n)]
    return [{"prompt": f"rev {w}", "response": w[::-1], "ground_truth": w[::-1]} for w in words]


def user_project(tmp_path: Path, *overrides: str):
    source = tmp_path / "words.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in reversed_words(200)))
    params = tiny_params(tmp_path)
    params["data"].update(source=str(source), task_args={}, num_sft=100, num_rl=40, num_eval=20, num_val=8,
                          num_preference=32)
    params["rl"]["reward"] = "exact_match"
    params["sft"]["pad_to"] = params["preference"]["pad_to"] = "auto"
    for section in ("rl", "eval"):
        params[section]["sampler"].update(gen_length="auto", steps="auto", block_length="auto")
    params["model"]["init"]["max_sequence_length"] = "auto"
    path = write_params(tmp_path / "params.yaml", params)
    return load_config(path, list(overrides), root=tmp_path)


def test_no_pairs_turns_the_stage_off_and_leaves_its_declared_outputs(tmp_path, caplog):
    cfg = user_project(tmp_path)
    summary = prepare(cfg)
    assert summary["counts"]["preference"] == 0
    assert any("data.num_preference is 32" in w and "preference stage will be off" in w for w in summary["warnings"])

    with caplog.at_level(logging.INFO):
        result = run_preference(cfg, progress=False)
    assert result["enabled"] is False and "no training row has an answer with a digit" in result["reason"]
    assert [r.getMessage() for r in caplog.records if "preference stage off" in r.getMessage()] == [
        f"preference stage off: {result['reason']}. Set preference.enabled: true to require it (it then needs pairs)."]
    out = cfg.stage_dir("preference")
    assert json.loads((Path(cfg.run.metrics_dir) / "preference.json").read_text()) == result
    for key in ("loss", "reward_margin", "reward_accuracy"):  # header only: DVC loads them, plots nothing
        assert list(csv.reader((out / f"{key}.csv").open())) == [["step", key]]
    # no record, no checkpoint, yet neither output is empty (DVC would warn at every repro)
    assert (out / "metrics.jsonl").read_text() == "\n"
    assert result["reason"] in (out / "checkpoints" / STAGE_OFF_NOTE).read_text()
    assert result["reason"] in (out / "model" / STAGE_OFF_NOTE).read_text()
    assert not (out / "model" / "config.json").exists()

    with pytest.raises(UserError, match="eval.checkpoints lists 'preference', but the preference stage was off"):
        run_eval(load_config(tmp_path / "params.yaml", ["eval.checkpoints=[preference]"], root=tmp_path))


def test_enabled_false_is_off_whatever_the_data(tmp_path):
    cfg = user_project(tmp_path, "preference.enabled=false")
    prepare(cfg)
    assert run_preference(cfg, progress=False) == {"enabled": False, "reason": "preference.enabled is false"}


def test_enabled_true_without_pairs_stops_prepare_before_writing(tmp_path):
    cfg = user_project(tmp_path, "preference.enabled=true")
    with pytest.raises(DataError, match=r"words.jsonl: no preference pairs, but preference.enabled is true: no training row"):
        prepare(cfg)
    assert not Path(cfg.data.prepared_dir).exists()


def test_enabled_accepts_only_true_false_auto(tmp_path):
    with pytest.raises(ValueError, match="key 'preference.enabled' must be true, false or auto, got 'maybe'"):
        user_project(tmp_path, "preference.enabled=maybe")
