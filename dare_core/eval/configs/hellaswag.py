"""`hellaswag`: HellaSwag (Zellers et al.) as released: hellaswag_val.jsonl, four endings per context."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import register_benchmark
from dare_core.eval.configs.common import (Choice, MultipleChoiceBenchmark, Record, check_shots, check_unique_ids,
                                           mc_row, read_jsonl, take)

_MARKER = re.compile(r"\s*\[\w+\]\s*")


def _clean(text: str) -> str:
    # WikiHow contexts keep scraping markers ("[header]", "[step]"); a title marker ends a sentence
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\s{2,}", " ", _MARKER.sub(" ", text)).strip()


def _item(rec: Record) -> Choice:
    endings = rec.need("endings", kind=list)
    label = rec.need("label", kind=int)
    if len(endings) != 4 or not all(isinstance(e, str) for e in endings):
        raise rec.fail(f"'endings' must be 4 strings, got {endings!r}")
    if not 0 <= label < 4:
        raise rec.fail(f"label {label} is not in 0..3")
    context = f"{_clean(rec.text('activity_label'))}: {_clean(rec.text('ctx'))}"
    endings = [_clean(e) for e in endings]
    question = f"{context}\n\nWhich ending continues the text most plausibly?"
    return Choice(rec.text("ind"), question, endings, label,
                  ll_context=context, ll_endings=[" " + e for e in endings])


@register_benchmark("hellaswag")
class HellaSwag(MultipleChoiceBenchmark):
    layout = ("hellaswag/hellaswag_val.jsonl (and hellaswag/hellaswag_train.jsonl for few-shot): Rowan Zellers' "
              "release, one JSON object per line with ind, activity_label, ctx_a, ctx_b, ctx, endings (4), "
              "label (int), split, split_type, source_id")

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        folder = Path(data_dir) / "hellaswag"
        path = self.require(folder / "hellaswag_val.jsonl")
        examples: list[Choice] = []
        if shots:
            train = self.require(folder / "hellaswag_train.jsonl")
            examples = [_item(r) for r in read_jsonl(train)[:shots]]
            check_shots(self.name, shots, len(examples), str(train))
        rows = [mc_row(_item(r), examples) for r in read_jsonl(path)]
        check_unique_ids(rows, str(path))
        return take(rows, max_samples)
