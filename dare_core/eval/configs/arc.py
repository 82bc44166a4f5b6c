"""`arc_c`: the AI2 Reasoning Challenge, Challenge set, in AI2's jsonl release.

Some items label their options "1".."4" instead of "A".."D"; options are relabelled by position
(A, B, ...) and the gold key follows its option, so every row uses letters."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import register_benchmark
from dare_core.eval.configs.common import (Choice, MultipleChoiceBenchmark, Record, check_shots, check_unique_ids,
                                           mc_row, read_jsonl, take)


def _item(rec: Record) -> Choice:
    question = rec.need("question", kind=dict)
    choices = question.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) and "text" in c and "label" in c for c in choices):
        raise rec.fail("'question.choices' must be a list of {text, label} objects")
    stem = question.get("stem")
    if not isinstance(stem, str) or not stem.strip():
        raise rec.fail("'question.stem' is missing or empty")
    keys = [str(c["label"]).strip() for c in choices]
    gold = rec.text("answerKey")
    if gold not in keys:
        raise rec.fail(f"answerKey {gold!r} is not one of the option labels {keys}")
    return Choice(rec.text("id"), stem, [str(c["text"]) for c in choices], keys.index(gold))


@register_benchmark("arc_c")
class ARCChallenge(MultipleChoiceBenchmark):
    layout = ("ARC-Challenge/ARC-Challenge-Test.jsonl (and ARC-Challenge/ARC-Challenge-Train.jsonl for few-shot): "
              "AI2's ARC release, one JSON object per line with id, question {stem, choices [{text, label}]}, answerKey")

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        folder = Path(data_dir) / "ARC-Challenge"
        path = self.require(folder / "ARC-Challenge-Test.jsonl")
        examples: list[Choice] = []
        if shots:
            train = self.require(folder / "ARC-Challenge-Train.jsonl")
            examples = [_item(r) for r in read_jsonl(train)[:shots]]
            check_shots(self.name, shots, len(examples), str(train))
        rows = [mc_row(_item(r), examples) for r in read_jsonl(path)]
        check_unique_ids(rows, str(path))
        return take(rows, max_samples)
