"""The user's own task: a training file, a separate test file, labels, disjoint splits, rewards
checked at prepare, and lengths derived from the data."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dare_core.config import ConfigError, DareConfig
from dare_core.data import lengths
from dare_core.data.prepare import prepare
from dare_core.data.schema import DataError


def digits(i: int) -> str:
    """Five digits, distinct for every i < 100000 (7919 is prime to 10)."""
    return " ".join(f"{(i * 7919 + 13) % 100000:05d}")


def sort_row(i: int) -> dict:
    d = digits(i)
    return {"prompt": f"sort {d}", "response": "".join(sorted(d.split())), "ground_truth": "".join(sorted(d.split()))}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def user_cfg(root: Path, n: int = 120, **data) -> DareConfig:
    root.mkdir(parents=True, exist_ok=True)
    cfg = DareConfig()
    cfg.data.prepared_dir, cfg.data.tokenizer_dir = str(root / "prepared"), str(root / "tokenizer")
    cfg.data.source = write_jsonl(root / "sort_digits.jsonl", [sort_row(i) for i in range(n)])
    cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval, cfg.data.num_val, cfg.data.num_preference = 60, 20, 20, 10, 0
    cfg.rl.reward = "arithmetic"  # sorted digits are integers; the reward is fixed per file, not per row
    cfg.sft.pad_to = cfg.preference.pad_to = "auto"  # every length left to the data, as docs/own-data.md sets them
    for sampler in (cfg.rl.sampler, cfg.eval.sampler):
        sampler.gen_length = sampler.steps = sampler.block_length = "auto"
    cfg.model.init = {"max_sequence_length": "auto"}
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def read(cfg: DareConfig, split: str) -> list[dict]:
    return pq.read_table(f"{cfg.data.prepared_dir}/{split}.parquet").to_pylist()


def test_eval_source_is_scored_as_given_and_never_carved(tmp_path):
    test_rows = [sort_row(1000 + i) for i in range(7)] + [sort_row(3)]  # the last one is also a training row
    cfg = user_cfg(tmp_path, eval_source=write_jsonl(tmp_path / "test.jsonl", test_rows))
    summary = prepare(cfg)
    rows = read(cfg, "eval")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in test_rows]  # every row, in order
    assert [r["ground_truth"] for r in rows] == [r["ground_truth"] for r in test_rows]
    # nothing carved: every distinct training prompt lands in sft, rl or val
    train = {r["prompt"] for s in ("sft", "rl", "val") for r in read(cfg, s)}
    assert len(train) == min(120, 60 + 20 + 10) and summary["counts"]["eval"] == 8
    assert summary["overlaps"]["eval_train"] == 1 and any("1 test prompts" in w for w in summary["warnings"])
    assert summary["eval_source"] == cfg.data.eval_source


def test_val_source_replaces_the_carved_validation_split(tmp_path):
    val_rows = [sort_row(2000 + i) for i in range(5)]
    cfg = user_cfg(tmp_path, val_source=write_jsonl(tmp_path / "val.jsonl", val_rows))
    summary = prepare(cfg)
    assert [r["prompt"] for r in read(cfg, "val")] == [r["prompt"] for r in val_rows]
    assert summary["counts"]["val"] == 5 and summary["overlaps"]["val_train"] == 0


def test_scores_are_labelled_by_the_task_name(tmp_path):
    cfg = user_cfg(tmp_path)
    prepare(cfg)
    assert {r["task"] for s in ("sft", "rl", "eval") for r in read(cfg, s)} == {"sort_digits"}  # the file's stem
    assert {r["reward"] for r in read(cfg, "eval")} == {"arithmetic"}
    cfg = user_cfg(tmp_path / "named", task_name="digit sorting")
    prepare(cfg)
    assert {r["task"] for r in read(cfg, "eval")} == {"digit sorting"}


def test_a_rows_own_task_column_names_it_and_picks_its_reward(tmp_path):
    cfg = user_cfg(tmp_path)
    cfg.rl.reward = "auto"
    rows = [{**sort_row(i), "task": "arithmetic"} for i in range(120)]
    cfg.data.source = write_jsonl(tmp_path / "mixed.jsonl", rows)
    prepare(cfg)
    assert {(r["task"], r["reward"]) for r in read(cfg, "rl")} == {("arithmetic", "arithmetic")}


def test_a_task_no_reward_grades_stops_prepare_and_says_what_to_set(tmp_path):
    cfg = user_cfg(tmp_path)
    cfg.rl.reward = "auto"
    cfg.data.task = "sort_digits"
    with pytest.raises(DataError, match=r"sort_digits.jsonl: line 1: no reward grades task .sort_digits.: set rl.reward"):
        prepare(cfg)
    assert not Path(cfg.data.prepared_dir).exists()


def test_a_ground_truth_the_reward_cannot_grade_names_file_row_and_column(tmp_path):
    rows = [sort_row(i) for i in range(120)]
    rows[37]["ground_truth"] = "1 2 4 4"
    cfg = user_cfg(tmp_path)
    cfg.data.source = write_jsonl(tmp_path / "sort_digits.jsonl", rows)
    with pytest.raises(DataError, match=r"sort_digits.jsonl: line 38: column 'ground_truth': .*'1 2 4 4' is not an integer"):
        prepare(cfg)
    assert not Path(cfg.data.prepared_dir).exists() and not Path(cfg.data.tokenizer_dir).exists()
    test_rows = [sort_row(1000), {"prompt": "sort 3 1", "ground_truth": "one three"}]
    cfg = user_cfg(tmp_path / "t", eval_source=write_jsonl(tmp_path / "test.jsonl", test_rows))
    with pytest.raises(DataError, match=r"test.jsonl: line 2: column 'ground_truth'"):
        prepare(cfg)


def test_rl_prompts_are_disjoint_from_sft_when_the_source_allows(tmp_path):
    cfg = user_cfg(tmp_path)
    summary = prepare(cfg)
    sft, rl = ({r["prompt"] for r in read(cfg, s)} for s in ("sft", "rl"))
    assert len(sft) == 60 and len(rl) == 20 and not sft & rl
    assert summary["overlaps"]["sft_rl"] == 0 and summary["warnings"] == []


def test_overlapping_sft_and_rl_are_reported_with_how_many(tmp_path):
    cfg = user_cfg(tmp_path, n=100)  # 100 - 20 eval - 10 val = 70 training prompts for 60 + 20
    summary = prepare(cfg)
    sft, rl = ({r["prompt"] for r in read(cfg, s)} for s in ("sft", "rl"))
    assert summary["overlaps"]["sft_rl"] == len(sft & rl) == 10
    assert summary["warnings"][0].startswith("10 of the 20 RL prompts are also SFT prompts")


def longest_response(cfg: DareConfig) -> int:
    return max(len(r["response"]) for r in read(cfg, "sft"))  # the char tokenizer: one token per character


def test_auto_lengths_follow_the_longest_response(tmp_path):
    cfg = user_cfg(tmp_path)
    cfg.rl.sampler.block_length = 4  # explicit: gen_length rounds up to whole blocks
    summary = prepare(cfg)
    n = longest_response(cfg)
    assert n == 5
    got = summary["lengths"]
    assert got["sft.pad_to"] == got["eval.sampler.gen_length"] == got["eval.sampler.block_length"] == n + 1
    assert got["eval.sampler.steps"] == n + 1  # one token per step
    assert (got["rl.sampler.gen_length"], got["rl.sampler.block_length"], got["rl.sampler.steps"]) == (8, 4, 8)
    # a from-scratch model whose init leaves its length open fits the longest prompt + canvas
    assert got["model.length"] == -(-(summary["max_prompt_tokens"] + 8) // 8) * 8 == summary["max_length"]
    resolved = lengths.resolve(cfg)
    assert (resolved.sft.pad_to, resolved.rl.sampler.gen_length, resolved.eval.sampler.steps) == (n + 1, 8, n + 1)
    assert resolved.model.init["max_sequence_length"] == got["model.length"]
    explicit = user_cfg(tmp_path / "explicit")
    explicit.sft.pad_to, explicit.model.init = 8, {}
    summary = prepare(explicit)  # the family's own length, an explicit canvas
    assert summary["lengths"]["sft.pad_to"] == 8 and "model.length" not in summary["lengths"] and summary["max_length"] == 128


def test_an_explicit_length_wins_over_auto(tmp_path):
    cfg = user_cfg(tmp_path)
    cfg.sft.pad_to, cfg.eval.sampler.gen_length, cfg.eval.sampler.block_length = 9, 12, 3
    cfg.model.init = {"max_sequence_length": 64}
    summary = prepare(cfg)
    assert summary["lengths"]["sft.pad_to"] == 9 and summary["lengths"]["eval.sampler.gen_length"] == 12
    assert summary["lengths"]["eval.sampler.steps"] == 12 and "model.length" not in summary["lengths"]
    assert summary["max_length"] == 64
    resolved = lengths.resolve(cfg)
    assert resolved.sft.pad_to == 9 and resolved.model.init == {"max_sequence_length": 64}


def test_auto_lengths_without_a_prepared_summary_say_to_run_prepare(tmp_path):
    cfg = user_cfg(tmp_path)
    with pytest.raises(ConfigError, match="run `dare stage prepare` first"):
        lengths.resolve(cfg)


@pytest.mark.parametrize("key", ["sft.pad_to", "rl.sampler.gen_length", "eval.sampler.gen_length"])
def test_a_fixed_length_too_short_for_the_answers_stops_prepare_with_the_numbers(tmp_path, key):
    """A sampler canvas shorter than the taught answers would cap accuracy silently (the eval rows of a
    test file carry no response, so the training responses are the measure); nothing is written."""
    test_rows = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in map(sort_row, range(1000, 1008))]
    cfg = user_cfg(tmp_path, eval_source=write_jsonl(tmp_path / "test.jsonl", test_rows))
    section, _, name = key.rpartition(".")
    target = cfg.sft if section == "sft" else getattr(cfg, section.split(".")[0]).sampler
    setattr(target, name, 5)  # the answers are 5 digits: 5 tokens + EOS need 6
    if section != "sft":
        target.block_length = target.steps = 5
    with pytest.raises(DataError) as caught:
        prepare(cfg)
    message = str(caught.value)
    assert f"response is 5 tokens + 1 EOS > {key} 5" in message and f"set {key} to auto" in message, message
    assert "at least 6" in message and str(tmp_path / "sort_digits.jsonl") in message
    assert not Path(cfg.data.prepared_dir).exists()


def test_model_init_shapes_are_checked_when_its_length_is_left_to_the_data(tmp_path):
    cfg = user_cfg(tmp_path)  # model.init: {max_sequence_length: auto}
    cfg.model.init = {"max_sequence_length": "auto", "d_model": 32, "n_heads": 3}
    with pytest.raises(ConfigError, match=r"model.init: n_heads \(3\) must divide the width d_model \(32\)"):
        prepare(cfg)
    assert not Path(cfg.data.prepared_dir).exists()
