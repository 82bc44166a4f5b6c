"""`math`: the MATH competition problems (Hendrycks et al.), graded with the `math` reward.

Two layouts: the original release (one JSON file per problem, the gold answer being the last
`\\boxed{}` of the solution) or a MATH-500 style jsonl with an explicit `answer`; the jsonl wins
when both are there."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import MissingBenchmarkData, register_benchmark
from dare_core.eval.configs.common import (MathBenchmark, Record, boxed_reference, check_shots, check_unique_ids,
                                           math_row, read_json_object, read_jsonl, take)


def _problem_files(split_dir: Path) -> list[Path]:
    def order(path: Path) -> tuple:
        return (path.parent.name, int(path.stem) if path.stem.isdigit() else -1, path.stem)

    return sorted(split_dir.glob("*/*.json"), key=order)


def _from_release(path: Path, rec: Record) -> dict:
    from dare_core.rewards.extract import last_boxed

    solution = rec.text("solution")
    gold = last_boxed(solution)
    if gold is None or not gold.strip():
        raise rec.fail("the solution has no \\boxed{} final answer")
    return {"id": f"{path.parent.name}/{path.stem}", "problem": rec.text("problem"), "answer": gold.strip(),
            "reference": solution, "subject": str(rec.get("type") or path.parent.name),
            "level": str(rec.get("level", ""))}


def _from_jsonl(rec: Record) -> dict:
    from dare_core.rewards.extract import last_boxed

    answer = rec.text("answer")
    solution = str(rec.get("solution") or "").strip()
    boxed = last_boxed(solution)
    # the reference must carry the gold answer in its last box, which a few solutions word differently
    if boxed is None or boxed.strip() != answer:
        solution = f"{solution}\n\n{boxed_reference(answer)}".strip()
    return {"id": rec.text("unique_id", "id"), "problem": rec.text("problem"), "answer": answer, "reference": solution,
            "subject": str(rec.get("subject", "")), "level": str(rec.get("level", ""))}


@register_benchmark("math")
class HendrycksMATH(MathBenchmark):
    layout = ("math/test/<subject>/<n>.json (the original Hendrycks MATH release: problem, level, type, solution "
              "with the answer in its last \\boxed{}) OR math/test.jsonl (MATH-500 style, one JSON object per line "
              "with problem, solution, answer, subject, level, unique_id; used when present); few-shot examples "
              "from math/train/<subject>/<n>.json")

    def _read_release(self, split_dir: Path) -> list[dict]:
        files = _problem_files(self.require(split_dir))
        if not files:
            raise MissingBenchmarkData(f"{self.name}: no <subject>/<n>.json files in {split_dir}. "
                                       f"Expected layout under the data folder: {self.layout}")
        return [_from_release(path, read_json_object(path)) for path in files]

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        folder = Path(data_dir) / "math"
        if (folder / "test.jsonl").exists():
            source = folder / "test.jsonl"
            items = [_from_jsonl(rec) for rec in read_jsonl(source)]
        else:
            source = folder / "test"
            items = self._read_release(source)
        examples: list[tuple[str, str]] = []
        if shots:
            train = self._read_release(folder / "train")
            check_shots(self.name, shots, len(train), str(folder / "train"))
            examples = [(t["problem"], t["reference"]) for t in train[:shots]]
        rows = [math_row(t["id"], t["problem"], t["answer"], t["reference"], examples,
                         subject=t["subject"], level=t["level"]) for t in items]
        check_unique_ids(rows, str(source))
        return take(rows, max_samples)
