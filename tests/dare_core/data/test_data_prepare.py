import json

import pyarrow.parquet as pq
import pytest

from dare_core.config import DareConfig
from dare_core.data.prepare import prepare
from dare_core.data.schema import DataError, read_rows
from dare_core.models.tokenizer import load_tokenizer


def make_cfg(root, **data) -> DareConfig:
    cfg = DareConfig()
    cfg.data.prepared_dir = str(root / "prepared")
    cfg.data.tokenizer_dir = str(root / "tokenizer")
    cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval, cfg.data.num_val = 60, 20, 20, 10
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def read(cfg, split):
    return pq.read_table(f"{cfg.data.prepared_dir}/{split}.parquet").to_pylist()


def test_synthetic_splits(tmp_path):
    cfg = make_cfg(tmp_path)
    summary = prepare(cfg)
    assert summary["counts"] == {"sft": 60, "rl": 20, "eval": 20, "val": 10, "preference": 80} and summary["task"] == "arithmetic"
    sft, rl, ev, val = read(cfg, "sft"), read(cfg, "rl"), read(cfg, "eval"), read(cfg, "val")
    assert not {r["prompt"] for r in ev} & {r["prompt"] for r in sft + rl}
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in sft + rl + ev}
    tok = load_tokenizer(cfg.data.tokenizer_dir)
    assert sft[0]["prompt_text"] == tok.apply_chat_template([{"role": "user", "content": sft[0]["prompt"]}])
    assert summary["max_prompt_tokens"] == max(len(tok.encode(r["prompt_text"])) for r in sft + rl + ev)
    assert json.loads((tmp_path / "prepared" / "summary.json").read_text()) == summary


def test_deterministic_by_seed(tmp_path):
    files = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        cfg = make_cfg(tmp_path / name, seed=seed)
        prepare(cfg)
        files[name] = [(tmp_path / name / "prepared" / f"{s}.parquet").read_bytes() for s in ("sft", "rl", "eval", "val")]
    assert files["a"] == files["b"]
    assert files["a"] != files["c"]


def test_small_task_overlaps_sft_rl_but_not_eval(tmp_path):
    # 1-digit "+" has 100 problems: eval 20 + val 10 + sft 60 + rl 40 cannot all be distinct.
    cfg = make_cfg(tmp_path, task_args={"max_digits": 1}, num_rl=40)
    prepare(cfg)
    ev, val = {r["prompt"] for r in read(cfg, "eval")}, {r["prompt"] for r in read(cfg, "val")}
    train = {r["prompt"] for r in read(cfg, "sft") + read(cfg, "rl")}
    assert len(train) == 70 and len(val) == 10 and not ev & train and not val & (ev | train)


def test_too_few_problems_says_how_many(tmp_path):
    cfg = make_cfg(tmp_path, task_args={"max_digits": 1}, num_sft=90)
    with pytest.raises(DataError, match=r"only 100 distinct.*num_eval \+ num_val \+ max\(num_sft, num_rl\) = 120"):
        prepare(cfg)


def test_val_split_is_held_out_and_leaves_the_other_splits_unchanged(tmp_path):
    """val comes off the end of the synthetic pool: sft, rl and eval are byte-identical to a
    preparation without it, and val shares no problem with any of them."""
    without, with_val = make_cfg(tmp_path / "a", num_val=0), make_cfg(tmp_path / "b", num_val=25)
    assert prepare(without)["counts"]["val"] == 0 and read(without, "val") == []
    assert prepare(with_val)["counts"]["val"] == 25
    for split in ("sft", "rl", "eval", "preference"):
        assert read(without, split) == read(with_val, split), split
    val = read_rows(f"{with_val.data.prepared_dir}/val.parquet", "val")
    others = {r["prompt"] for split in ("sft", "rl", "eval") for r in read(with_val, split)}
    assert len({r["prompt"] for r in val}) == 25 and not {r["prompt"] for r in val} & others
    assert [r["uid"] for r in val] == [f"val-{i}" for i in range(25)]
    assert all(r["ground_truth"] and r["prompt_text"] for r in val)


def test_val_split_of_a_source_file(tmp_path):
    source = tmp_path / "raw.jsonl"
    rows = [{"prompt": f"{i}+1=", "response": str(i + 1), "ground_truth": str(i + 1), "uid": f"u{i}"} for i in range(20)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(tmp_path, source=str(source), num_sft=8, num_rl=8, num_eval=4, num_val=6)
    assert prepare(cfg)["counts"]["val"] == 6
    val = read(cfg, "val")
    assert {r["uid"] for r in val} <= {f"u{i}" for i in range(20)}
    assert not {r["prompt"] for r in val} & {r["prompt"] for split in ("sft", "rl", "eval") for r in read(cfg, split)}
    cfg.data.num_val = 10  # 4 + 10 + 8 > 20
    with pytest.raises(DataError, match=r"raw.jsonl: 20 distinct prompts, need .*num_val.* = 22"):
        prepare(cfg)


def test_malformed_source_names_line_and_writes_nothing(tmp_path):
    source = tmp_path / "raw.jsonl"
    source.write_text('{"prompt": "1+1=", "response": "2", "ground_truth": "2"}\nnot json\n')
    cfg = make_cfg(tmp_path, source=str(source))
    with pytest.raises(DataError, match="raw.jsonl: line 2"):
        prepare(cfg)
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "tokenizer").exists()


def test_source_row_missing_prompt(tmp_path):
    source = tmp_path / "raw.jsonl"
    rows = [{"prompt": f"{i}+1=", "response": str(i + 1), "ground_truth": str(i + 1)} for i in range(10)]
    del rows[4]["prompt"]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="raw.jsonl: line 5: column 'prompt' is missing"):
        prepare(make_cfg(tmp_path, source=str(source)))
    assert not (tmp_path / "prepared").exists()


def test_source_file(tmp_path):
    source = tmp_path / "raw.jsonl"
    rows = [{"prompt": f"{i}+1=", "response": str(i + 1), "ground_truth": str(i + 1), "uid": f"u{i}"}
            for i in range(12)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(tmp_path, source=str(source), num_sft=8, num_rl=8, num_eval=4, num_val=0)
    summary = prepare(cfg)
    assert summary["counts"] == {"sft": 8, "rl": 8, "eval": 4, "val": 0, "preference": 8}
    ev = read(cfg, "eval")
    assert {r["uid"] for r in ev} <= {f"u{i}" for i in range(12)}
    assert not {r["prompt"] for r in ev} & {r["prompt"] for r in read(cfg, "sft") + read(cfg, "rl")}


def test_too_long_prompt_names_row_and_writes_nothing(tmp_path):
    cfg = make_cfg(tmp_path)
    cfg.model.init = {"max_sequence_length": 16}
    cfg.data.task_args = {"min_digits": 3, "max_digits": 3}
    # chat template overhead is 2 tokens; "123+456=" is 8 more; + 8 canvas = 18 > 16
    expected = r"task arithmetic: sft row 1: prompt is 10 tokens .* = 18 > max sequence length 16"
    with pytest.raises(DataError, match=expected):
        prepare(cfg)
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "tokenizer").exists()


def test_model_path_tokenizer_and_limit(tmp_path):
    from dare_core.models.tokenizer import build_char_tokenizer

    model = tmp_path / "model"
    build_char_tokenizer(model)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 12}))
    cfg = make_cfg(tmp_path)
    cfg.model.path = str(model)
    with pytest.raises(DataError, match="max sequence length 12"):
        prepare(cfg)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    assert prepare(cfg)["max_length"] == 64
    assert not (tmp_path / "tokenizer").exists()  # an existing model's tokenizer is not copied
