import json

import pytest

from dare_core.data.schema import DataError, Place, read_rows, write_rows

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
    with pytest.raises(DataError, match=rf"raw.jsonl: line 18: column 'prompt' {problem}"):
        read_rows(path, "source")


def test_a_jsonl_row_is_named_by_its_line_blank_lines_counted(tmp_path):
    # what an editor shows: the blank lines the reader skips still have numbers
    path = tmp_path / "raw.jsonl"
    good = json.dumps({"prompt": "p", "response": "r", "ground_truth": "g"})
    path.write_text(f"{good}\n\n   \n{good}\n\n" + json.dumps({"prompt": "p", "response": "r"}) + "\n")
    with pytest.raises(DataError, match=r"raw.jsonl: line 6: column 'ground_truth' is missing"):
        read_rows(path, "source")


def test_a_parquet_row_is_named_from_1(tmp_path):
    path = tmp_path / "eval.parquet"
    write_rows(path, [dict(ROW, uid=f"rl-{i}") for i in range(3)], "rl")
    with pytest.raises(DataError, match=r"eval.parquet: row 1: column 'response' is missing"):
        read_rows(path, "source")  # the first data row lacks it: row 1, as a spreadsheet shows it


def test_rows_keep_their_place_only_when_asked(tmp_path):
    path = tmp_path / "raw.jsonl"
    path.write_text("\n" + "\n\n".join(json.dumps({"prompt": p, "response": "r", "ground_truth": "g"}) for p in "ab"))
    rows = read_rows(path, "source", where=True)
    assert [r["_where"] for r in rows] == [Place(str(path), "line", 2), Place(str(path), "line", 4)]
    assert str(rows[1]["_where"]) == f"{path}: line 4"
    assert all("_where" not in r for r in read_rows(path, "source"))


def test_write_rejects_invalid_rows_and_writes_nothing(tmp_path):
    with pytest.raises(DataError, match="rl.parquet: row 2: column 'prompt_text'"):
        write_rows(tmp_path / "rl.parquet", [ROW, dict(ROW, prompt_text="")], "rl")
    assert not list(tmp_path.iterdir())
