"""The public benchmarks read their release formats (tiny fixtures in those formats) and grade the
way they should: references score 1, garbage and wrong answers 0, missing and malformed files fail
with messages that say where and what was expected."""
from __future__ import annotations

import csv
import gzip
import json
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from eval_fixtures import write_benchmark_fixtures

from dare_core.eval.configs import BENCHMARKS, MissingBenchmarkData, get_benchmark, parse_benchmarks
from dare_core.eval.configs.common import BenchmarkDataError, choice_letter
from dare_core.eval.configs.gpqa import shuffled_options

NAMES = ["mmlu", "mmlu_pro", "hellaswag", "arc_c", "gsm8k", "math", "gpqa", "aime24", "aime25", "olympiadbench",
         "humaneval", "mbpp"]
MC = {"mmlu", "mmlu_pro", "hellaswag", "arc_c", "gpqa"}
CODE = {"humaneval", "mbpp"}
# the file (or folder) each benchmark's test items are read from
MAIN = {"mmlu": "mmlu/test", "mmlu_pro": "mmlu_pro/data/test-00000-of-00001.parquet",
        "hellaswag": "hellaswag/hellaswag_val.jsonl", "arc_c": "ARC-Challenge/ARC-Challenge-Test.jsonl",
        "gsm8k": "gsm8k/test.jsonl", "math": "math/test", "gpqa": "gpqa/gpqa_diamond.csv",
        "aime24": "aime24/aime24.jsonl", "aime25": "aime25/aime25.jsonl",
        "olympiadbench": "olympiadbench/OE_TO_maths_en_COMP.json", "humaneval": "humaneval/HumanEval.jsonl",
        "mbpp": "mbpp/mbpp.jsonl"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchmarks")
    return root, write_benchmark_fixtures(root, n=4)


@pytest.fixture
def fresh(tmp_path):
    """A private copy to damage."""
    write_benchmark_fixtures(tmp_path, n=3)
    return tmp_path


def wrong_response(name: str, row: dict) -> str:
    if name in MC:
        return f"The answer is \\boxed{{{next(label for label in row['labels'] if label != row['answer'])}}}."
    if name == "humaneval":
        return f"```python\ndef {row['entry_point']}(*args):\n    return None\n```"
    if name == "mbpp":
        function = re.search(r"assert\s+(\w+)\(", row["answer"]).group(1)
        return f"```python\ndef {function}(*args):\n    return -1\n```"
    return "So the answer is \\boxed{987654321}."


def test_registry_order_and_exports():
    assert list(BENCHMARKS)[:len(NAMES)] == NAMES and "task" in BENCHMARKS
    assert parse_benchmarks("gsm8k, math") == ["gsm8k", "math"]


@pytest.mark.parametrize("name", NAMES)
def test_rows_and_grading(data, name):
    root, loaded = data
    bench = get_benchmark(name)
    rows = bench.load(root)
    assert rows and rows == loaded[name]
    # code items each run a sandboxed subprocess: grade two of them
    graded = rows[:2] if name in CODE else rows
    for row in graded:
        assert isinstance(row["id"], str) and row["question"].isascii()
        assert bench.grade(row, row["reference"]) == 1.0, row["id"]
        assert bench.grade(row, wrong_response(name, row)) == 0.0, row["id"]
    for garbage in ("zzz qq", ""):
        assert bench.grade(rows[0], garbage) == 0.0
    if name in MC:
        assert bench.modes == ("gen", "ll") and bench.gen["gen_length"] <= 64
        for row in rows:
            assert row["answer"] in row["labels"] and len(row["choices"]) == len(row["labels"])
            assert row["question"].rstrip().endswith("\\boxed{X}.")
    else:
        assert bench.gen["gen_length"] >= 256


@pytest.mark.parametrize("name", NAMES)
def test_ids_unique_and_stable(data, name):
    root, _ = data
    first, second = get_benchmark(name).load(root), get_benchmark(name).load(root)
    ids = [r["id"] for r in first]
    assert len(set(ids)) == len(ids) and ids == [r["id"] for r in second]
    assert first == second
    assert len(get_benchmark(name).load(root, max_samples=2)) == 2


@pytest.mark.parametrize("name", NAMES)
def test_missing_file_names_path_and_layout(fresh, name):
    target = fresh / MAIN[name]
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    bench = get_benchmark(name)
    with pytest.raises(MissingBenchmarkData) as err:
        bench.load(fresh)
    assert str(target) in str(err.value) and bench.layout in str(err.value)


def _append_line(path, text: str) -> int:
    with open(path, "a") as f:
        f.write(text + "\n")
    return len(path.read_text().splitlines())


def _damage(name: str, root) -> tuple[str, str]:
    """Break one item of the benchmark's main file; (the file the error must name, its position)."""
    path = root / MAIN[name]
    if name == "mmlu":
        path = sorted(path.glob("*_test.csv"))[0]
        return str(path), f"line {_append_line(path, 'only,three,fields')}"
    if name == "mmlu_pro":
        rows = pq.read_table(path).to_pylist()
        rows.append(dict(rows[0], question_id=999, answer="Z"))
        pq.write_table(pa.Table.from_pylist(rows), path)
        return str(path), f"row {len(rows)}"  # counted from 1
    if name == "math":
        path = path / "algebra" / "0.json"
        path.write_text('{"problem": "x", "solution": ')
        return str(path), "line 1"
    if name == "gpqa":
        return str(path), f"line {_append_line(path, 'a question,its answer')}"
    if name == "olympiadbench":
        items = json.loads(path.read_text())
        items.append({"id": 1, "final_answer": ["$1$"]})
        path.write_text(json.dumps(items))
        return str(path), f"item {len(items)}"  # counted from 1
    bad = {"hellaswag": "{not json", "arc_c": json.dumps({"id": "x", "question": {"stem": "q", "choices": []}}),
           "gsm8k": json.dumps({"question": "q", "answer": "no final line"}), "aime24": json.dumps({"problem": "p"}),
           "aime25": json.dumps({"question": "q"}), "humaneval": "[1, 2]",
           "mbpp": json.dumps({"task_id": 500, "text": "t", "code": "c"})}[name]
    return str(path), f"line {_append_line(path, bad)}"


@pytest.mark.parametrize("name", NAMES)
def test_malformed_row_names_file_and_line(fresh, name):
    path, where = _damage(name, fresh)
    with pytest.raises(BenchmarkDataError) as err:
        get_benchmark(name).load(fresh)
    assert f"{path}: {where}" in str(err.value)


@pytest.mark.parametrize("name", ["gpqa", "aime24", "aime25", "olympiadbench", "humaneval"])
def test_no_fewshot_source_is_an_error(data, name):
    with pytest.raises(ValueError, match="few-shot"):
        get_benchmark(name).load(data[0], shots=1)


def test_gpqa_shuffle_is_deterministic_and_gold_points_to_correct_answer(data):
    root, _ = data
    with open(root / "gpqa" / "gpqa_diamond.csv", newline="") as f:
        correct = {r["Record ID"]: r["Correct Answer"] for r in csv.DictReader(f)}
    rows = get_benchmark("gpqa").load(root)
    for row in rows:
        assert f"\n{row['answer']}. {correct[row['id']]}\n" in row["question"]
    assert len({r["answer"] for r in rows}) > 1
    # pinned: a SHA-256 seed, so the order is the same in every process and on every machine
    assert shuffled_options("recFixture0000", "right", ["w1", "w2", "w3"]) == (
        shuffled_options("recFixture0000", "right", ["w1", "w2", "w3"]))
    assert shuffled_options("recFixture0000", "right", ["w1", "w2", "w3"]) == PINNED_SHUFFLE


PINNED_SHUFFLE = (["w2", "w1", "w3", "right"], 3)


def test_arc_numeric_labels_are_letters(data):
    root, _ = data
    raw = [json.loads(line) for line in (root / MAIN["arc_c"]).read_text().splitlines()]
    numeric = [r for r in raw if r["question"]["choices"][0]["label"] == "1"]
    assert numeric
    rows = {r["id"]: r for r in get_benchmark("arc_c").load(root)}
    for item in numeric:
        row = rows[item["id"]]
        gold = int(item["answerKey"]) - 1
        assert row["labels"][0] == "A" and row["answer"] == "ABCDE"[gold]
        assert f"{row['answer']}. {item['question']['choices'][gold]['text']}" in row["question"]
    assert any(len(r["labels"]) == 5 for r in rows.values())


def test_mmlu_fewshot_prefix_comes_from_dev(data):
    root, _ = data
    rows = get_benchmark("mmlu").load(root, shots=2)
    row = rows[0]
    dev = list(csv.reader(open(root / "mmlu" / "dev" / f"{row['subject']}_dev.csv", newline="")))
    assert row["question"].startswith(f"Question: {dev[0][0]}\n")
    assert f"Question: {dev[1][0]}\n" in row["question"] and f"\\boxed{{{dev[1][5]}}}" in row["question"]
    assert dev[2][0] not in row["question"]
    assert row["context"].startswith(f"Question: {dev[0][0]}\n") and f"Answer: {dev[0][5]}\n\n" in row["context"]
    assert row["context"].endswith("\nAnswer:")
    with pytest.raises(ValueError, match="only 5"):
        get_benchmark("mmlu").load(root, shots=6)


def test_mbpp_splits(data):
    root, _ = data
    rows = get_benchmark("mbpp").load(root)
    assert [r["id"] for r in rows] == [str(i) for i in range(11, 15)]
    shot = get_benchmark("mbpp").load(root, shots=3)[0]["question"]
    for task_id in (2, 3, 4):
        assert f"scaled_sum_{task_id}(" in shot
    assert "scaled_sum_1(" not in shot and "scaled_sum_5(" not in shot
    with pytest.raises(ValueError, match="shots"):
        get_benchmark("mbpp").load(root, shots=4)


def test_fewshot_sources(data):
    root, _ = data
    for name in ("mmlu_pro", "hellaswag", "arc_c", "gsm8k", "math"):
        rows = get_benchmark(name).load(root, shots=2)
        assert rows[0]["question"].startswith("Question: ") and rows[0]["question"].count("\nAnswer: ") == 2
    gsm = get_benchmark("gsm8k").load(root, shots=1)[0]["question"]
    assert "<<" not in gsm and gsm.endswith("Please reason step by step, and put your final answer within \\boxed{}.")
    hs = get_benchmark("hellaswag").load(root, shots=1)[0]
    assert hs["context"].count("\n\n") == 1 and hs["choices"][0].startswith(" ")


def test_math_jsonl_takes_precedence(data, tmp_path):
    shutil.copytree(data[0] / "math", tmp_path / "math")
    (tmp_path / "math" / "test.jsonl").write_text(json.dumps(
        {"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2", "subject": "Prealgebra",
         "level": 1, "unique_id": "test/prealgebra/1.json"}) + "\n")
    rows = get_benchmark("math").load(tmp_path)
    assert [r["id"] for r in rows] == ["test/prealgebra/1.json"] and rows[0]["answer"] == "2"
    assert get_benchmark("math").grade(rows[0], "\\boxed{2}") == 1.0


def test_humaneval_completion_only_and_gzip(data, tmp_path):
    folder = tmp_path / "humaneval"
    folder.mkdir()
    with gzip.open(folder / "HumanEval.jsonl.gz", "wt") as f:
        f.write((data[0] / MAIN["humaneval"]).read_text())
    bench = get_benchmark("humaneval")
    row = bench.load(tmp_path)[1]
    assert row["entry_point"] == "is_palindrome_word"
    body = "    lowered = text.lower()\n    return lowered == lowered[::-1]\n"
    assert bench.grade(row, f"```python\n{body}```") == 1.0
    # a whole function that leaves out the prompt's `from typing import List`
    first = bench.load(tmp_path)[0]
    whole = ("def running_max(numbers: List[int]) -> List[int]:\n    out = []\n    for x in numbers:\n"
             "        out.append(x if not out else max(out[-1], x))\n    return out\n")
    assert bench.grade(first, f"Here it is:\n```python\n{whole}```") == 1.0



def test_humaneval_tests_call_the_prompts_helper(tmp_path):
    """HumanEval/38's layout: the tests call the prompt's encode_cyclic, which the answer may redefine."""
    prompt = ('\n\ndef encode_cyclic(s: str):\n    """Rotate each group of three."""\n'
              '    groups = [s[3 * i:min(3 * i + 3, len(s))] for i in range((len(s) + 2) // 3)]\n'
              '    return "".join(g[1:] + g[0] if len(g) == 3 else g for g in groups)\n\n\n'
              'def decode_cyclic(s: str):\n    """Undo encode_cyclic."""\n')
    test = ("\n\ndef check(candidate):\n    for text in ['abcdef', 'hello world', 'xy']:\n"
            "        assert candidate(encode_cyclic(text)) == text\n")
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "humaneval" / "HumanEval.jsonl").write_text(json.dumps(
        {"task_id": "HumanEval/38", "prompt": prompt, "canonical_solution": "", "test": test, "entry_point": "decode_cyclic"}) + "\n")
    bench = get_benchmark("humaneval")
    row = bench.load(tmp_path)[0]
    right = "    return encode_cyclic(encode_cyclic(s))\n"
    assert bench.grade(row, f"```python\n{right}```") == 1.0
    # an answer that redefines the helper as the identity and decodes as the identity: the tests
    # still encode with the prompt's helper
    forged = "def encode_cyclic(s):\n    return s\n\n\ndef decode_cyclic(s):\n    return s\n"
    assert bench.grade(row, f"```python\n{forged}```") == 0.0

def test_olympiadbench_multiple_answers_in_order(data):
    bench = get_benchmark("olympiadbench")
    row = next(r for r in bench.load(data[0]) if len(r["parts"]) == 2)
    first, second = row["parts"]
    assert bench.grade(row, f"\\boxed{{{first}, {second}}}") == 1.0
    assert bench.grade(row, f"x = \\boxed{{{first}}} or x = \\boxed{{{second}}}") == 1.0
    assert bench.grade(row, f"\\boxed{{{second}, {first}}}") == 0.0
    assert bench.grade(row, f"\\boxed{{{first}}}") == 0.0
    pairs = next(r for r in bench.load(data[0]) if r["answer_type"] == "Tuple")
    assert pairs["parts"] == ["(1,2)", "(2,1)"] and pairs["answer"] == "(1,2), (2,1)"
    assert bench.grade(pairs, "\\boxed{(1, 2), (2, 1)}") == 1.0
    assert bench.grade(pairs, "\\boxed{(2, 1), (1, 2)}") == 0.0


def test_gsm8k_any_n(tmp_path):
    rows = write_benchmark_fixtures(tmp_path, n=64)["gsm8k"]
    assert len(rows) == 64 and len({r["question"] for r in rows}) == 64
    assert all(get_benchmark("gsm8k").grade(r, r["reference"]) == 1.0 for r in rows)


@pytest.mark.parametrize("response, expected", [
    ("Let me think. \\boxed{B} is wrong; so \\boxed{C}", "C"),
    ("The answer is $\\boxed{\\text{D}}$.", "D"),
    ("The answer is (C).", "C"),
    ("so the answer is A", "A"),
    ("Reasoning...\nAnswer: D", "D"),
    ("The correct answer is: **B**", "B"),
    ("B", "B"),
    ("B. because it is larger", "B"),
    ("(A) it is", "A"),
    ("zzz qq", None),
    ("", None),
    ("A cat sat on the mat.", None),
    ("The answer is \\boxed{E}", None),
    ("Answer: F", None),
    ("E", None),
])
def test_choice_letter(response, expected):
    assert choice_letter(response, ["A", "B", "C", "D"]) == expected
