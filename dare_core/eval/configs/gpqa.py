"""`gpqa`: GPQA Diamond from the original release (gpqa_diamond.csv).

The CSV lists the correct answer first; options are shuffled per item with a generator seeded from
a SHA-256 of the item's Record ID, so the gold letter is spread over A-D and identical on every
machine and Python run (Python's own `hash` is salted per process)."""
from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import register_benchmark
from dare_core.eval.configs.common import (Choice, MultipleChoiceBenchmark, Record, check_unique_ids, mc_row,
                                           no_fewshot, read_csv, take)

_REQUIRED = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


def shuffled_options(key: str, correct: str, incorrect: list[str]) -> tuple[list[str], int]:
    """The four options in the item's fixed shuffled order, and the index of the correct one."""
    seed = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    order = [0, 1, 2, 3]
    random.Random(seed).shuffle(order)
    options = [correct, *incorrect]
    return [options[i] for i in order], order.index(0)


def _item(rec: Record) -> Choice:
    question = rec.text("Question")
    # a copy without the Record ID column still gets a stable id, from the question text
    key = str(rec.get("Record ID") or "").strip() or "q-" + hashlib.sha256(question.encode("utf-8")).hexdigest()[:16]
    options = [rec.text(c) for c in _REQUIRED[1:]]
    shuffled, gold = shuffled_options(key, options[0], options[1:])
    return Choice(key, question, shuffled, gold)


@register_benchmark("gpqa")
class GPQADiamond(MultipleChoiceBenchmark):
    layout = ("gpqa/gpqa_diamond.csv: the original GPQA release, CSV with a header row including Question, "
              "Correct Answer, Incorrect Answer 1, Incorrect Answer 2, Incorrect Answer 3, Record ID")

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        no_fewshot(self.name, shots)
        path = self.require(Path(data_dir) / "gpqa" / "gpqa_diamond.csv")
        rows = [mc_row(_item(rec)) for rec in read_csv(path, required=_REQUIRED)]
        check_unique_ids(rows, str(path))
        return take(rows, max_samples)
