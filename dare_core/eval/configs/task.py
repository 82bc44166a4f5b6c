"""`task`: a prepared eval file of DARE's own (data/prepared/eval.parquet, or any file in the `eval`
schema), graded by each row's reward (its `reward`/`reward_args` columns, else its task's; see
dare_core.rewards.scoring). The embedded default evaluates its synthetic task
through this benchmark, on the same OpenCompass path as the public ones.

The prompt is used as prepared (`prompt_text`, already rendered with the chat template the model
was trained on), so the model sees exactly what it saw in RL."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import Benchmark, register_benchmark


@register_benchmark("task")
class PreparedTask(Benchmark):
    layout = ("a prepared eval file: <data>/eval.parquet (or eval.jsonl), or the file itself, with the columns "
              "prompt, ground_truth, task, uid, prompt_text (what `dare stage prepare` writes)")
    chat = False

    def source(self, data_dir: Path) -> Path:
        data_dir = Path(data_dir)
        if data_dir.is_file():
            return data_dir
        for name in ("eval.parquet", "eval.jsonl"):
            if (data_dir / name).exists():
                return data_dir / name
        return self.require(data_dir / "eval.parquet")

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        from dare_core.data.schema import read_rows

        if shots:
            raise ValueError("task: few-shot prompts are not supported (prompts are used as prepared)")
        rows = read_rows(self.source(data_dir), "eval")
        if max_samples:
            rows = rows[:max_samples]
        # every row has every key (None where a row carries no reward of its own): the rows become
        # one table in OpenCompass
        return [{"id": r["uid"], "uid": r["uid"], "question": r["prompt_text"], "answer": r["ground_truth"],
                 "reference": r["ground_truth"], "task": r["task"],
                 "reward": r.get("reward"), "reward_args": r.get("reward_args")} for r in rows]

    def grade(self, row: dict, response: str) -> float:
        from dare_core.rewards.scoring import score_row

        # `answer` is what a benchmark grades against; scoring reads it as the row's ground truth
        return float(score_row({**row, "ground_truth": row["answer"]}, response).acc)

    def report_name(self, data_dir: Path) -> str:
        """The task of the rows (e.g. `arithmetic`): the embedded table reads as that task."""
        rows = self.load(data_dir, max_samples=1)
        return rows[0]["task"] if rows else self.name
