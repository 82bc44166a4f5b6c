"""`humaneval`: OpenAI HumanEval (HumanEval.jsonl, or the released HumanEval.jsonl.gz), graded by
running the item's `check` in the `code` reward's sandbox.

Answers are graded after the original prompt: a whole function then finds the prompt's imports and
helpers, and an answer that does not define the entry point (only its body) completes the prompt."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import Benchmark, register_benchmark
from dare_core.eval.configs.common import REASONING_GEN, Record, check_unique_ids, no_fewshot, read_jsonl, take

INSTRUCTION = "Complete the following Python function. Put the complete function in a ```python code block."


def _row(rec: Record) -> dict:
    prompt = rec.need("prompt")
    entry = rec.text("entry_point")
    if not entry.isidentifier():
        raise rec.fail(f"entry_point {entry!r} is not a Python identifier")
    solution = rec.need("canonical_solution")
    tests = rec.need("test")
    fenced = prompt.strip("\n") + "\n"
    return {"id": rec.text("task_id"), "question": f"{INSTRUCTION}\n\n```python\n{fenced}```",
            "answer": json.dumps({"tests": tests, "entry_point": entry}),
            "reference": f"```python\n{prompt}{solution}\n```", "prompt": prompt, "entry_point": entry}


@register_benchmark("humaneval")
class HumanEval(Benchmark):
    layout = ("humaneval/HumanEval.jsonl (or humaneval/HumanEval.jsonl.gz as released by openai/human-eval): one "
              "JSON object per line with task_id, prompt, canonical_solution, test, entry_point")
    gen = REASONING_GEN

    def source(self, data_dir: Path) -> Path:
        folder = Path(data_dir) / "humaneval"
        if not (folder / "HumanEval.jsonl").exists() and (folder / "HumanEval.jsonl.gz").exists():
            return folder / "HumanEval.jsonl.gz"
        return self.require(folder / "HumanEval.jsonl")

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        no_fewshot(self.name, shots)
        path = self.source(data_dir)
        rows = [_row(rec) for rec in read_jsonl(path)]
        check_unique_ids(rows, str(path))
        return take(rows, max_samples)

    def grade(self, row: dict, response: str) -> float:
        from dare_core.rewards import compute_reward
        from dare_core.rewards.extract import extract_code

        program = extract_code(response)
        if not program.strip():
            return 0.0
        prompt = row["prompt"] if row["prompt"].endswith("\n") else row["prompt"] + "\n"
        if re.search(rf"^def\s+{re.escape(row['entry_point'])}\s*\(", program, re.MULTILINE):
            # the prompt's imports and helper functions, which whole-function answers often leave out;
            # its docstring-only stub of the entry point is then redefined by the answer
            program = f"{prompt}\n\n{program}"
        else:
            program = prompt + program
        # `program` holds no fence (it is a fence's body or fence-free text), so the reward runs it whole;
        # the tests' jail takes the helpers its tests call (HumanEval/38's encode_cyclic) from the
        # prompt, never from the answer
        return float(compute_reward("code", program, row["answer"], {"prompt": row["prompt"]}).acc)
