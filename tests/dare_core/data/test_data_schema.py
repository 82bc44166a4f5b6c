import json

import pytest

from dare_core.data.schema import DataError, read_rows, write_rows

ROW = {"prompt": "1+1=", "ground_truth": "2", "task": "arithmetic", "uid": "rl-0", "prompt_text": "x"}


def test_parquet_round_trip(tmp_path):
    rows = [dict(ROW, uid=f"rl-{i}") for i in range(3)]
    write_rows(tmp_path / "rl.parquet", [dict(r, extra="dropped") for r in rows], "rl")
    assert read_rows(tmp_path / "rl.parquet", "rl") == rows


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found: .*nope.jsonl"):
        read_rows(tmp_path / "nope.jsonl", "source")


def test_malformed_jsonl_names_line(tmp_path):
    path = tmp_path / "raw.jsonl"
    path.write_text('{"prompt": "a", "response": "b", "ground_truth": "b"}\n\n{"prompt": \n')
    with pytest.raises(DataError, match=r"raw.jsonl: line 3"):
        read_rows(path, "source")


@pytest.mark.parametrize("bad, problem", [({"prompt": None}, "is missing"), ({"prompt": 3}, "must be a string"),
                                          ({"prompt": ""}, "is an empty string")])
def test_bad_row_names_row_and_column(tmp_path, bad, problem):
    path = tmp_path / "raw.jsonl"
    rows = [{"prompt": "p", "response": "r", "ground_truth": "g"} for _ in range(20)]
    rows[17].update(bad)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=rf"raw.jsonl: row 17: column 'prompt' {problem}"):
        read_rows(path, "source")


def test_write_rejects_invalid_rows_and_writes_nothing(tmp_path):
    with pytest.raises(DataError, match="row 1: column 'prompt_text'"):
        write_rows(tmp_path / "rl.parquet", [ROW, dict(ROW, prompt_text="")], "rl")
    assert not list(tmp_path.iterdir())
