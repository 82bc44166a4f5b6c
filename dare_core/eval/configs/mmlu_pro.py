"""`mmlu_pro`: MMLU-Pro (TIGER-Lab) as on the Hub: parquet files with up to ten options per question."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import register_benchmark
from dare_core.eval.configs.common import (LETTERS, Choice, MultipleChoiceBenchmark, check_shots, check_unique_ids,
                                           mc_row, read_parquet, take)

_COLUMNS = ("question_id", "question", "options", "answer", "answer_index", "category")


def _items(path: Path) -> list[tuple[str, Choice]]:
    items = []
    for rec in read_parquet(path, _COLUMNS):
        options = rec.need("options", kind=list)
        gold = rec.text("answer")
        if not 2 <= len(options) <= 10:
            raise rec.fail(f"{len(options)} options, expected 2 to 10")
        if len(gold) != 1 or gold not in LETTERS[:len(options)]:
            raise rec.fail(f"answer {gold!r} is not one of the {len(options)} option letters")
        if rec.get("answer_index") is not None and rec["answer_index"] != LETTERS.index(gold):
            raise rec.fail(f"answer {gold!r} disagrees with answer_index {rec['answer_index']}")
        item = Choice(rec.text("question_id"), rec.text("question"), [str(o) for o in options], LETTERS.index(gold))
        items.append((rec.text("category"), item))
    return items


@register_benchmark("mmlu_pro")
class MMLUPro(MultipleChoiceBenchmark):
    layout = ("mmlu_pro/data/test-00000-of-00001.parquet (and mmlu_pro/data/validation-00000-of-00001.parquet "
              "for few-shot): TIGER-Lab/MMLU-Pro as on the Hub, columns question_id, question, options, answer, "
              "answer_index, cot_content, category, src")

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        folder = Path(data_dir) / "mmlu_pro" / "data"
        test = self.require(folder / "test-00000-of-00001.parquet")
        by_category: dict[str, list[Choice]] = {}
        if shots:
            # examples of the question's own category, as in the MMLU-Pro paper's 5-shot setting
            validation = self.require(folder / "validation-00000-of-00001.parquet")
            for category, item in _items(validation):
                by_category.setdefault(category, []).append(item)
        rows = []
        for category, item in _items(test):
            examples = by_category.get(category, [])
            if shots:
                check_shots(self.name, shots, len(examples), f"the validation split's category '{category}'")
            rows.append(mc_row(item, examples[:shots], category=category))
        check_unique_ids(rows, str(test))
        return take(rows, max_samples)
