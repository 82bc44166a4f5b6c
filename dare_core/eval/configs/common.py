"""Pieces shared by the public benchmarks: file readers whose errors name the file and the line,
the multiple-choice question format and its letter extraction, math rows, few-shot prefixes.

Every reader returns `Record`s: dicts that remember where they were read (`path: line N`, `row N`
for parquet, `item N` for a JSON list; rows and items counted from 1, as a user counts them), so a bad
field can be reported at its place in the file.
"""
from __future__ import annotations

import csv
import gzip
import json
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

from dare_core.data.schema import json_lines
from dare_core.eval.configs.base import Benchmark

LETTERS = string.ascii_uppercase
MC_INSTRUCTION = "Answer with the letter of the correct option in the form \\boxed{X}."
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MC_GEN = {"gen_length": 32, "steps": 32}
REASONING_GEN = {"gen_length": 256, "steps": 256}
LONG_REASONING_GEN = {"gen_length": 512, "steps": 512}


class BenchmarkDataError(ValueError):
    """A benchmark file that is present but malformed; the message names the file and the line."""


class Record(dict):
    """One item as read from a file, with `where` it came from (for error messages)."""

    def __init__(self, data: dict, where: str):
        super().__init__(data)
        self.where = where

    def fail(self, problem: str) -> BenchmarkDataError:
        return BenchmarkDataError(f"{self.where}: {problem}")

    def need(self, *names: str, kind: type | tuple = str) -> Any:
        """The value of the first of `names` present (alternative spellings of one field)."""
        for name in names:
            if name in self and self[name] is not None:
                value = self[name]
                if not isinstance(value, kind):
                    raise self.fail(f"field '{name}' has type {type(value).__name__}, expected {_kind_name(kind)}")
                return value
        raise self.fail(f"missing field {' / '.join(repr(n) for n in names)}")

    def text(self, *names: str) -> str:
        """A non-empty string field; integers (AIME answers, ids) are accepted and converted."""
        value = self.need(*names, kind=(str, int))
        value = str(value).strip()
        if not value:
            raise self.fail(f"field '{names[0]}' is empty")
        return value


def _kind_name(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


# ---- readers -------------------------------------------------------------------------------------


def _open_text(path: Path):
    # HumanEval ships gzipped; "-sig" drops a byte-order mark that spreadsheet exports put first
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig", newline="")


def read_jsonl(path: Path) -> list[Record]:
    return [Record(obj, f"{path}: line {lineno}")
            for lineno, obj in json_lines(Path(path), BenchmarkDataError, _open_text(Path(path)))]


def _read_json(path: Path) -> Any:
    try:
        with _open_text(Path(path)) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise BenchmarkDataError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from exc


def read_json_object(path: Path) -> Record:
    obj = _read_json(path)
    if not isinstance(obj, dict):
        raise BenchmarkDataError(f"{path}: line 1: expected a JSON object, got {type(obj).__name__}")
    return Record(obj, str(path))


def read_json_list(path: Path) -> list[Record]:
    items = _read_json(path)
    if not isinstance(items, list):
        raise BenchmarkDataError(f"{path}: line 1: expected a JSON list, got {type(items).__name__}")
    records = []
    for number, obj in enumerate(items, start=1):
        where = f"{path}: item {number}"
        if not isinstance(obj, dict):
            raise BenchmarkDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        records.append(Record(obj, where))
    return records


def read_csv(path: Path, columns: Optional[Sequence[str]] = None, required: Sequence[str] = ()) -> list[Record]:
    """Without `columns` the first row is the header; with them the file has none and every row must
    have exactly that many fields. `required` header columns must be present."""
    records = []
    with _open_text(Path(path)) as f:
        reader = csv.reader(f)
        header = list(columns) if columns is not None else next(reader, None)
        if header is None:
            raise BenchmarkDataError(f"{path}: line 1: empty file, expected a header row")
        missing = [c for c in required if c not in header]
        if missing:
            raise BenchmarkDataError(f"{path}: line 1: header lacks column(s) {missing}; it has {header}")
        start = reader.line_num + 1
        for fields in reader:
            where = f"{path}: line {start}"
            start = reader.line_num + 1
            if not fields:
                continue
            if len(fields) != len(header):
                raise BenchmarkDataError(f"{where}: {len(fields)} fields, expected {len(header)} ({', '.join(header)})")
            records.append(Record(dict(zip(header, fields)), where))
    return records


def read_parquet(path: Path, columns: Sequence[str]) -> list[Record]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise BenchmarkDataError(f"{path}: cannot read parquet: {exc}") from exc
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise BenchmarkDataError(f"{path}: missing column(s) {missing}; it has {table.column_names}")
    rows = table.select(list(columns)).to_pylist()
    return [Record(row, f"{path}: row {number}") for number, row in enumerate(rows, start=1)]


# ---- rows ----------------------------------------------------------------------------------------


def take(rows: list[dict], max_samples: int) -> list[dict]:
    return rows[:max_samples] if max_samples and max_samples > 0 else rows


def check_unique_ids(rows: Sequence[dict], source: str) -> None:
    seen: set = set()
    for row in rows:
        if row["id"] in seen:
            raise BenchmarkDataError(f"{source}: duplicate item id {row['id']!r}")
        seen.add(row["id"])


def no_fewshot(name: str, shots: int) -> None:
    if shots:
        raise ValueError(f"{name}: few-shot prompts are not supported (the public release has no dev/train "
                         f"split to draw examples from); use shots=0")


def check_shots(name: str, shots: int, available: int, source: str) -> None:
    if shots < 0:
        raise ValueError(f"{name}: shots must be >= 0, got {shots}")
    if shots > available:
        raise ValueError(f"{name}: {shots} shots requested but {source} has only {available} examples")


def fewshot_prompt(examples: Sequence[tuple[str, str]], question: str) -> str:
    """Solved examples, then the question in the same `Question:` frame; the question alone without examples."""
    if not examples:
        return question
    solved = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in examples)
    return f"{solved}Question: {question}"


def math_question(problem: str, examples: Sequence[tuple[str, str]] = ()) -> str:
    return fewshot_prompt(examples, f"{problem.strip()}\n{MATH_INSTRUCTION}")


def math_row(id: str, problem: str, answer: str, reference: str, examples: Sequence[tuple[str, str]] = (),
             **extra: Any) -> dict:
    """A row graded on the boxed final answer; `examples` are (problem, worked solution) pairs."""
    return {"id": id, "question": math_question(problem, examples), "answer": answer, "reference": reference, **extra}


def boxed_reference(answer: str) -> str:
    return f"The final answer is \\boxed{{{answer}}}."


# ---- multiple choice -----------------------------------------------------------------------------


@dataclass
class Choice:
    """A multiple-choice item before it becomes a row. `ll_context`/`ll_endings` replace the default
    log-likelihood scoring (the letter after "Answer:") where the benchmark scores its endings."""

    id: str
    question: str
    options: list[str]
    gold: int
    ll_context: Optional[str] = None
    ll_endings: Optional[list[str]] = None

    @property
    def labels(self) -> list[str]:
        return list(LETTERS[:len(self.options)])

    @property
    def letter(self) -> str:
        return LETTERS[self.gold]

    def body(self) -> str:
        lines = [self.question.strip()] + [f"{label}. {option.strip()}" for label, option in zip(self.labels, self.options)]
        return "\n".join(lines)

    def ll_solved(self) -> str:
        if self.ll_context is not None:
            return self.ll_context + self.ll_endings[self.gold]
        return f"Question: {self.body()}\nAnswer: {self.letter}"


def mc_reference(letter: str) -> str:
    return f"The answer is \\boxed{{{letter}}}."


def mc_row(item: Choice, examples: Sequence[Choice] = (), **extra: Any) -> dict:
    """The row of one item. gen: options lettered, the boxed-letter instruction last; ll: by default
    the same question ending in "Answer:" scored against " A", " B", ...; examples precede both."""
    if not 2 <= len(item.options) <= len(LETTERS) or not 0 <= item.gold < len(item.options):
        raise ValueError(f"{item.id}: {len(item.options)} options with gold index {item.gold}")
    question = fewshot_prompt([(e.body(), mc_reference(e.letter)) for e in examples],
                              f"{item.body()}\n\n{MC_INSTRUCTION}")
    prefix = "".join(e.ll_solved() + "\n\n" for e in examples)
    if item.ll_context is not None:
        context, choices = prefix + item.ll_context, list(item.ll_endings)
    else:
        context, choices = f"{prefix}Question: {item.body()}\nAnswer:", [f" {label}" for label in item.labels]
    return {"id": item.id, "question": question, "answer": item.letter, "reference": mc_reference(item.letter),
            "labels": item.labels, "choices": choices, "context": context, **extra}


_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\{(.*)\}$", re.DOTALL)
_LEADING_LETTER = re.compile(r"^\(([A-Za-z])\)|^([A-Za-z])(?:[.:)]|$)")
_ANSWER_IS = re.compile(
    r"(?i:\banswer\s*(?:is\b\s*:?|:))\s*(?:(?i:option|choice)\s+)?[*_]*\s*\(?\s*([A-Z])\s*\)?(?![A-Za-z0-9])")
_BARE = re.compile(r"^\(([A-Z])\)|^([A-Z])(?:[.:)\n]|$)")


def _boxed_letter(content: str) -> Optional[str]:
    content = content.strip().strip("$ ").rstrip(".").strip()
    match = _TEXT_WRAP.match(content)
    if match:
        content = match.group(1).strip()
    match = _LEADING_LETTER.match(content)
    if not match:
        return None
    return (match.group(1) or match.group(2)).upper()


def choice_letter(response: str, labels: Sequence[str]) -> Optional[str]:
    """The option letter a response chose, or None. The first form found decides (a letter outside
    `labels` is None): the last `\\boxed{X}`; the last "answer is (X)" / "answer is X" / "Answer: X";
    a response that is just "X" or starts with "X." / "X)" / "(X)". Lower-case letters count only in
    a box, where "a" cannot be the article."""
    from dare_core.rewards.extract import last_boxed

    boxed = last_boxed(response)
    letter = _boxed_letter(boxed) if boxed is not None else None
    if letter is None:
        found = _ANSWER_IS.findall(response)
        letter = found[-1] if found else None
    if letter is None:
        match = _BARE.match(response.strip().strip("*_ ").strip())
        letter = (match.group(1) or match.group(2)) if match else None
    return letter if letter in labels else None


class MultipleChoiceBenchmark(Benchmark):
    """Graded on the chosen letter; rows come from `mc_row`."""

    modes: ClassVar[tuple] = ("gen", "ll")
    gen: ClassVar[dict] = MC_GEN

    def grade(self, row: dict, response: str) -> float:
        return float(choice_letter(response, row["labels"]) == row["answer"])


class MathBenchmark(Benchmark):
    """Graded with the `math` reward: the last boxed answer, symbolically equivalent to `answer`."""

    gen: ClassVar[dict] = REASONING_GEN

    def grade(self, row: dict, response: str) -> float:
        from dare_core.rewards import compute_reward

        return float(compute_reward("math", response, row["answer"]).acc)
