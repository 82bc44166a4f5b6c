"""`olympiadbench`: OlympiadBench (Hothan/OlympiadBench), the text-only English competition-math
open-ended subset (OE_TO_maths_en_COMP), graded with the `math` reward.

Items with several answers are graded part by part, in order: the last box split at its top-level
commas, or else the last boxes, one per part."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from dare_core.eval.configs.base import register_benchmark
from dare_core.eval.configs.common import (LONG_REASONING_GEN, MathBenchmark, Record, boxed_reference,
                                           check_unique_ids, math_row, no_fewshot, read_json_list, take)


def split_top_level(text: str) -> list[str]:
    """`text` split at commas outside brackets, so tuples and intervals stay whole."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _all_boxed(text: str) -> list[str]:
    """The contents of every balanced `\\boxed{...}` in order (nested boxes are part of their outer box)."""
    from dare_core.rewards.extract import braced

    found, pos = [], 0
    while (match := _BOX.search(text, pos)) is not None:
        group = braced(text, match.end() - 1)
        if group is None:
            pos = match.end()
            continue
        found.append(group[0].strip())
        pos = group[1]
    return found


def _predicted_parts(response: str, count: int) -> Optional[list[str]]:
    boxes = _all_boxed(response)
    if not boxes:
        return None
    last = split_top_level(boxes[-1])
    if len(last) == count:
        return last
    return boxes[-count:] if len(boxes) >= count else None


def _item(rec: Record) -> dict:
    answers = rec.need("final_answer", kind=list)
    if not answers or not all(isinstance(a, str) and a.strip("$ ") for a in answers):
        raise rec.fail(f"'final_answer' must be a non-empty list of non-empty strings, got {answers!r}")
    parts = [a.strip().strip("$").strip() for a in answers]
    gold = ", ".join(parts)
    question = rec.text("question")
    context = rec.get("context")
    if isinstance(context, str) and context.strip():
        question = f"{context.strip()}\n\n{question}"
    row = math_row(rec.text("id"), question, gold, boxed_reference(gold),
                   answer_type=str(rec.get("answer_type") or ""))
    # one answer may itself contain commas (a point, an interval): only flagged items are graded in
    # parts, whether the release lists the parts separately or as one comma-separated string
    row["parts"] = [p for a in parts for p in split_top_level(a)] if rec.get("is_multiple_answer") else [gold]
    return row


@register_benchmark("olympiadbench")
class OlympiadBench(MathBenchmark):
    layout = ("olympiadbench/OE_TO_maths_en_COMP.json: Hothan/OlympiadBench text-only English competition math, "
              "a JSON list of objects with id, question, final_answer (list of strings), is_multiple_answer, unit, "
              "answer_type, solution, context")
    gen = LONG_REASONING_GEN

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        no_fewshot(self.name, shots)
        path = self.require(Path(data_dir) / "olympiadbench" / "OE_TO_maths_en_COMP.json")
        rows = [_item(rec) for rec in read_json_list(path)]
        check_unique_ids(rows, str(path))
        return take(rows, max_samples)

    def grade(self, row: dict, response: str) -> float:
        from dare_core.rewards.math import math_equal

        parts = row.get("parts") or [row["answer"]]
        if len(parts) == 1:
            return super().grade(row, response)
        predicted = _predicted_parts(response, len(parts))
        if predicted is None:
            return 0.0
        return float(all(math_equal(p, g)[0] for p, g in zip(predicted, parts)))
