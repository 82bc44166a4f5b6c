"""The preference split: pairs derived from the synthetic task (the true answer against the task's
own demonstration error or a one-digit slip), or read from data.preference_source with errors that
name the file and the row; never on an eval prompt."""
import json

import pyarrow.parquet as pq
import pytest

from dare_core.config import DareConfig
from dare_core.data.prepare import prepare
from dare_core.data.schema import DataError


def make_cfg(root, **data) -> DareConfig:
    cfg = DareConfig()
    cfg.data.prepared_dir = str(root / "prepared")
    cfg.data.tokenizer_dir = str(root / "tokenizer")
    cfg.data.num_val = 0  # no in-loop validation split: these pools are sized for sft, rl and eval
    cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval = 60, 20, 20
    cfg.data.task_args = {"min_digits": 1, "max_digits": 3, "zero_pad": True, "demo_error_rate": 0.5}
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def auto_sampler_lengths(cfg) -> None:
    """Sampler canvases that hold these answers (longer than the code's default canvas)."""
    for sampler in (cfg.rl.sampler, cfg.eval.sampler):
        sampler.gen_length = sampler.steps = sampler.block_length = "auto"


def read(cfg, split):
    return pq.read_table(f"{cfg.data.prepared_dir}/{split}.parquet").to_pylist()


def test_derived_pairs_prefer_the_true_sum(tmp_path):
    cfg = make_cfg(tmp_path, num_preference=50)
    summary = prepare(cfg)
    pairs = read(cfg, "preference")
    assert summary["counts"]["preference"] == len(pairs) == 50
    assert summary["preference"] == {"origin": "derived from task arithmetic", "dropped_eval_prompts": 0}
    carry = 0
    for p in pairs:
        a, b = p["prompt"].rstrip("=").split("+")
        assert p["chosen"] == str(int(a) + int(b)).zfill(4) and p["rejected"] != p["chosen"]
        assert len(p["rejected"]) == len(p["chosen"]) and p["uid"].startswith("preference-")
        assert p["prompt_text"] and p["task"] == "arithmetic"
        diff = [i for i, (x, y) in enumerate(zip(p["chosen"], p["rejected"])) if x != y]
        if int(p["chosen"]) - int(p["rejected"]) == 10 and (int(a) % 10 + int(b) % 10) >= 10:
            carry += 1  # the task's forgotten carry
        else:
            assert len(diff) == 1  # one digit off
    assert carry > 0
    assert not {p["prompt"] for p in pairs} & {r["prompt"] for r in read(cfg, "eval")}
    # deterministic
    again = make_cfg(tmp_path / "again", num_preference=50)
    prepare(again)
    assert read(again, "preference") == pairs


def _source(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_preference_source_file(tmp_path):
    rows = [{"prompt": f"{i:03d}+001=", "chosen": f"{i + 1:04d}", "rejected": f"{i + 2:04d}"} for i in range(300)]
    cfg = make_cfg(tmp_path)
    cfg.data.preference_source = _source(tmp_path, rows)
    summary = prepare(cfg)
    pairs = read(cfg, "preference")
    eval_prompts = {r["prompt"] for r in read(cfg, "eval")}
    kept = [r for r in rows if r["prompt"] not in eval_prompts]
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [(r["prompt"], r["chosen"], r["rejected"]) for r in kept]
    assert summary["preference"]["dropped_eval_prompts"] == len(rows) - len(kept)
    assert summary["preference"]["origin"].endswith("pairs.jsonl")


@pytest.mark.parametrize("bad, message", [
    ({"rejected": None}, r"pairs.jsonl: line 4: column 'rejected' is missing"),
    ({"chosen": 12}, r"pairs.jsonl: line 4: column 'chosen' must be a string"),
    ({"rejected": "0002"}, r"pairs.jsonl: line 4: columns 'chosen' and 'rejected' are identical"),
    ({"chosen": "0123456789"}, r"pairs.jsonl: line 4: column 'chosen' is 10 tokens \+ 1 EOS > preference.pad_to 8"),
])
def test_malformed_preference_source_names_file_and_row_and_writes_nothing(tmp_path, bad, message):
    rows = [{"prompt": f"{i}+1=", "chosen": "0002", "rejected": "0003"} for i in range(5)]
    rows[3].update(bad)
    rows[3] = {k: v for k, v in rows[3].items() if v is not None}
    cfg = make_cfg(tmp_path)
    cfg.data.preference_source = _source(tmp_path, rows)
    with pytest.raises(DataError, match=message):
        prepare(cfg)
    assert not (tmp_path / "prepared").exists()


def test_source_data_derives_pairs_from_the_answer_in_the_response(tmp_path):
    rows = [{"prompt": f"q{i}", "response": f"the answer is {i + 10}", "ground_truth": str(i + 10)} for i in range(30)]
    rows[5]["response"] = "no number here"
    cfg = make_cfg(tmp_path, num_sft=20, num_rl=10, num_eval=5)
    cfg.data.source = _source(tmp_path, rows, "raw.jsonl")
    cfg.preference.pad_to = cfg.sft.pad_to = 24
    auto_sampler_lengths(cfg)
    cfg.model.init = {"max_sequence_length": 64}
    prepare(cfg)
    pairs = read(cfg, "preference")
    assert 0 < len(pairs) <= 25
    for p in pairs:
        assert p["chosen"].startswith("the answer is ") and p["rejected"].startswith("the answer is ")
        assert p["chosen"] != p["rejected"] and p["chosen"] != "no number here"


def test_rows_without_a_derivable_pair_give_an_empty_split(tmp_path):
    # a ground truth that is a checker's spec, not text of the response (as countdown's "15|7,7,1")
    rows = [{"prompt": f"q{i}", "response": f"<answer>{i}+1</answer>", "ground_truth": f"{i + 1}|{i},1", "task": "countdown"}
            for i in range(12)]
    cfg = make_cfg(tmp_path, num_sft=8, num_rl=8, num_eval=4)
    cfg.data.source = _source(tmp_path, rows, "raw.jsonl")
    cfg.sft.pad_to = 24
    auto_sampler_lengths(cfg)
    cfg.model.init = {"max_sequence_length": 64}
    summary = prepare(cfg)
    assert summary["counts"]["preference"] == 0 and read(cfg, "preference") == []
