"""`mmlu`: MMLU (Hendrycks et al.) as released in data.tar: one header-less CSV per subject and split."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import MissingBenchmarkData, register_benchmark
from dare_core.eval.configs.common import (Choice, MultipleChoiceBenchmark, check_shots, check_unique_ids, mc_row,
                                           read_csv, take)

_COLUMNS = ("question", "A", "B", "C", "D", "answer")


def _items(path: Path, subject: str) -> list[Choice]:
    items = []
    for index, rec in enumerate(read_csv(path, columns=_COLUMNS)):
        gold = rec["answer"].strip()
        if gold not in "ABCD" or len(gold) != 1:
            raise rec.fail(f"answer {gold!r} is not one of A, B, C, D")
        items.append(Choice(f"{subject}/{index}", rec["question"], [rec[k] for k in "ABCD"], "ABCD".index(gold)))
    return items


@register_benchmark("mmlu")
class MMLU(MultipleChoiceBenchmark):
    layout = ("mmlu/test/<subject>_test.csv (and mmlu/dev/<subject>_dev.csv for few-shot): the original "
              "Hendrycks release, CSV without header, columns question, A, B, C, D, answer letter")

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        test_dir = self.require(Path(data_dir) / "mmlu" / "test")
        files = sorted(test_dir.glob("*_test.csv"))
        if not files:
            raise MissingBenchmarkData(f"{self.name}: no *_test.csv files in {test_dir}. "
                                       f"Expected layout under the data folder: {self.layout}")
        rows = []
        for path in files:
            subject = path.name[:-len("_test.csv")]
            examples = []
            if shots:
                dev = self.require(Path(data_dir) / "mmlu" / "dev" / f"{subject}_dev.csv")
                examples = _items(dev, subject)
                check_shots(self.name, shots, len(examples), str(dev))
            rows += [mc_row(item, examples[:shots], subject=subject) for item in _items(path, subject)]
        check_unique_ids(rows, str(test_dir))
        return take(rows, max_samples)
