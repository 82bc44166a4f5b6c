"""Prepare's errors name a row where the user finds it: the line of a JSON-lines file as an editor
shows it (blank lines counted), the row of a parquet file from 1 (as a spreadsheet shows it)."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dare_core.data.prepare import prepare
from dare_core.data.schema import DataError
from test_user_data import sort_row, user_cfg


def write_lines(path: Path, rows: list, blank_before: int) -> str:
    """`rows` as JSON lines, with a blank line (which the reader skips) before the row at `blank_before`."""
    lines = [json.dumps(r) for r in rows]
    lines.insert(blank_before, "")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_bad_row_after_a_blank_line_is_named_by_its_line(tmp_path):
    rows = [sort_row(i) for i in range(120)]
    rows[37]["ground_truth"] = "1 2 4 4"
    cfg = user_cfg(tmp_path)
    cfg.data.source = write_lines(tmp_path / "raw.jsonl", rows, blank_before=10)
    # the 38th row stands on line 39: the blank line 11 comes before it
    with pytest.raises(DataError, match=r"raw.jsonl: line 39: column 'ground_truth': .*'1 2 4 4' is not an integer"):
        prepare(cfg)


def test_rows_with_one_prompt_and_different_answers_are_named_by_their_lines(tmp_path):
    rows = [sort_row(i) for i in range(120)]
    rows.append({**rows[2], "response": "7", "ground_truth": "7"})
    cfg = user_cfg(tmp_path)
    cfg.data.source = write_lines(tmp_path / "raw.jsonl", rows, blank_before=0)
    with pytest.raises(DataError, match=r"raw.jsonl: lines 4 and 122 have the same prompt but different ground truths"):
        prepare(cfg)


def test_a_test_file_with_one_uid_twice_names_both_lines(tmp_path):
    test_rows = [{**sort_row(1000 + i), "uid": f"t{i}"} for i in range(5)]
    test_rows[4]["uid"] = "t1"
    cfg = user_cfg(tmp_path, eval_source=write_lines(tmp_path / "test.jsonl", test_rows, blank_before=3))
    with pytest.raises(DataError, match=r"test.jsonl: lines 2 and 6 have the same uid 't1'"):
        prepare(cfg)


def test_a_bad_parquet_row_is_named_from_1(tmp_path):
    rows = [sort_row(i) for i in range(120)]
    rows[0]["ground_truth"] = "1 2 4 4"
    source = tmp_path / "raw.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    cfg = user_cfg(tmp_path, source=str(source))
    with pytest.raises(DataError, match=r"raw.parquet: row 1: column 'ground_truth': .*'1 2 4 4' is not an integer"):
        prepare(cfg)


def test_a_derived_pair_is_named_by_its_number_and_the_line_it_comes_from(tmp_path):
    cfg = user_cfg(tmp_path)
    cfg.data.num_preference = 5
    cfg.preference.pad_to = 2  # no response of five digits fits
    with pytest.raises(DataError, match=r"^derived preference pair 1 \(from .*sort_digits.jsonl: line \d+\): "
                                        r"column 'chosen' is \d+ tokens \+ 1 EOS > preference.pad_to 2"):
        prepare(cfg)
