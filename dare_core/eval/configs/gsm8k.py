"""`gsm8k`: GSM8K (openai/grade-school-math) test.jsonl, graded with the `gsm8k` reward."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import Benchmark, register_benchmark
from dare_core.eval.configs.common import REASONING_GEN, Record, check_shots, math_row, read_jsonl, take

# calculator annotations such as <<48/2=24>> were tool calls for the annotators, not solution text
_CALC = re.compile(r"<<[^<>]*>>")


def _parse(rec: Record) -> tuple[str, str, str]:
    """(question, gold number, worked solution ending in the boxed answer)."""
    solution = rec.text("answer")
    if "####" not in solution:
        raise rec.fail("'answer' has no '#### <number>' final line")
    work, final = solution.rsplit("####", 1)
    gold = final.strip().replace(",", "")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", gold):
        raise rec.fail(f"final answer {final.strip()!r} after '####' is not a number")
    reference = f"{_CALC.sub('', work).strip()}\nThe answer is \\boxed{{{gold}}}."
    return rec.text("question"), gold, reference


@register_benchmark("gsm8k")
class GSM8K(Benchmark):
    layout = ("gsm8k/test.jsonl (and gsm8k/train.jsonl for few-shot): openai/grade-school-math, one JSON object "
              "per line with 'question' and 'answer' (worked solution ending in '#### <number>')")
    gen = REASONING_GEN

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        folder = Path(data_dir) / "gsm8k"
        path = self.require(folder / "test.jsonl")
        examples: list[tuple[str, str]] = []
        if shots:
            train = self.require(folder / "train.jsonl")
            examples = [(q, ref) for q, _, ref in map(_parse, read_jsonl(train)[:shots])]
            check_shots(self.name, shots, len(examples), str(train))
        rows = []
        for index, rec in enumerate(read_jsonl(path)):
            question, gold, reference = _parse(rec)
            # the release has no ids; the item's position in test.jsonl is stable
            rows.append(math_row(f"test/{index}", question, gold, reference, examples))
        return take(rows, max_samples)

    def grade(self, row: dict, response: str) -> float:
        from dare_core.rewards import compute_reward

        return float(compute_reward("gsm8k", response, row["answer"]).acc)
