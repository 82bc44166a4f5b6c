"""`aime24`, `aime25`: AIME problems, one JSON object per line, graded with the `math` reward.

Field names differ between exports (Maxwell-Jia/AIME_2024 uses Problem/Answer, OpenCompass's files
question/answer), so each field is accepted under any of its known spellings."""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from dare_core.eval.configs.base import register_benchmark
from dare_core.eval.configs.common import (LONG_REASONING_GEN, MathBenchmark, boxed_reference, check_unique_ids,
                                           math_row, no_fewshot, read_jsonl, take)

_PROBLEM = ("problem", "question", "Problem")
_ANSWER = ("answer", "Answer", "gold_answer")
_ID = ("id", "ID", "problem_id", "unique_id")


class AIME(MathBenchmark):
    path: ClassVar[str] = ""
    gen = LONG_REASONING_GEN

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        no_fewshot(self.name, shots)
        path = self.require(Path(data_dir) / self.path)
        rows = []
        for index, rec in enumerate(read_jsonl(path)):
            # exports without ids are identified by position, which is stable for a given file
            ident = next((rec.text(k) for k in _ID if rec.get(k) not in (None, "")), str(index))
            answer = rec.text(*_ANSWER)
            rows.append(math_row(ident, rec.text(*_PROBLEM), answer, boxed_reference(answer)))
        check_unique_ids(rows, str(path))
        return take(rows, max_samples)


_LAYOUT = ("{path}: one JSON object per line with the problem under 'problem', 'question' or 'Problem' and the "
           "integer answer under 'answer', 'Answer' or 'gold_answer' (e.g. Maxwell-Jia/AIME_2024 exported to jsonl, "
           "or OpenCompass's AIME file)")


@register_benchmark("aime24")
class AIME24(AIME):
    path = "aime24/aime24.jsonl"
    layout = _LAYOUT.format(path=path)


@register_benchmark("aime25")
class AIME25(AIME):
    path = "aime25/aime25.jsonl"
    layout = _LAYOUT.format(path=path)
