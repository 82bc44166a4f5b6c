"""What a benchmark is to DARE: where its files live, how to read them, how to grade a response.

Each benchmark is one file in this folder, a `Benchmark` subclass registered by name. It reads the
benchmark's public on-disk format from a folder the user names (never downloading anything) and
turns each test item into one row, a plain dict:

- `id`:        a stable id (str), used to seed per-item sampling noise;
- `question`:  the full user message: instructions, few-shot examples, the options of a
               multiple-choice item, and the answer format the grader parses;
- `answer`:    what the grader compares against (a number, a LaTeX answer, an option letter, the
               tests of a code item);
- `reference`: a response that a perfect model would give, graded 1 (tests and format examples);
- multiple-choice rows also carry `labels` (["A", "B", ...]), `choices` (the continuation scored
  for each label in log-likelihood mode) and `context` (the text those continuations follow).

`opencompass_dataset` (in `dare_core.eval.opencompass`) wraps a benchmark into an OpenCompass
dataset config; `grade` is called by its evaluator for every prediction.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Sequence

from dare_core.registry import Registry


class MissingBenchmarkData(FileNotFoundError):
    """A benchmark file is not where the benchmark's layout says; the message names both."""


BENCHMARKS = Registry("benchmark")


def register_benchmark(name: str):
    return BENCHMARKS.register(name, set_name=True)


class Benchmark:
    """One benchmark. Subclasses set the class attributes and implement `load` and `grade`."""

    name: ClassVar[str] = ""
    # the expected layout under the data folder, shown in errors, e.g. "gsm8k/test.jsonl (one JSON
    # object per line with 'question' and 'answer', as in openai/grade-school-math)"
    layout: ClassVar[str] = ""
    # "gen": the model writes an answer that `grade` checks; "ll": the option whose continuation has
    # the highest ELBO log-likelihood is the prediction (multiple choice only)
    modes: ClassVar[tuple] = ("gen",)
    # generation settings this benchmark needs (gen_length, steps): published evaluation settings
    gen: ClassVar[dict] = {}
    # whether the question is a chat turn (rendered with the model's chat template)
    chat: ClassVar[bool] = True

    def require(self, path: Path) -> Path:
        """`path` if it exists, else a MissingBenchmarkData naming it and the expected layout."""
        if not Path(path).exists():
            raise MissingBenchmarkData(
                f"{self.name}: missing {path}. Expected layout under the data folder: {self.layout}")
        return Path(path)

    def load(self, data_dir: Path, shots: int = 0, **options: Any) -> list[dict]:
        """The test rows. `shots` > 0 prepends that many solved examples from the benchmark's
        own dev/train split to every question (an error if the benchmark has none)."""
        raise NotImplementedError

    def grade(self, row: dict, response: str) -> float:
        """1.0 if `response` answers `row` correctly, else 0.0 (partial credit where defined)."""
        raise NotImplementedError

    def report_name(self, data_dir: Path) -> str:
        """The name scores are reported under (the benchmark's own, unless the data names one)."""
        return self.name


def get_benchmark(name: str) -> Benchmark:
    return BENCHMARKS.lookup(name)()


def parse_benchmarks(spec: str | Sequence[str]) -> list[str]:
    """'gsm8k,math' or ['gsm8k', 'math'] -> validated names, in order."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    for n in names:
        BENCHMARKS.lookup(n)
    return names
