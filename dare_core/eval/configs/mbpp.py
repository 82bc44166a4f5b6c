"""`mbpp`: MBPP (google-research) from the original mbpp.jsonl, graded by running the item's asserts
in the `code` reward's sandbox.

Splits follow the MBPP paper: task ids 11-510 are the test set and 2-4 the few-shot examples."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dare_core.eval.configs.base import Benchmark, register_benchmark
from dare_core.eval.configs.common import (REASONING_GEN, Record, check_shots, check_unique_ids, fewshot_prompt,
                                           read_jsonl, take)

TEST_IDS = range(11, 511)
FEWSHOT_IDS = (2, 3, 4)
INSTRUCTION = "Write the Python function in a ```python code block."


def _parts(rec: Record) -> tuple[int, str, str, list[str], str]:
    """(problem id (the release's `task_id`), text, solution code, asserts, setup code); the release's code uses CRLF line ends."""
    problem_id = rec.need("task_id", kind=int)
    tests = rec.need("test_list", kind=list)
    if not tests or not all(isinstance(t, str) for t in tests):
        raise rec.fail("'test_list' must be a non-empty list of assert strings")
    code = rec.need("code").replace("\r\n", "\n")
    setup = str(rec.get("test_setup_code") or "").replace("\r\n", "\n")
    return problem_id, rec.text("text"), code, [t.replace("\r\n", "\n") for t in tests], setup


def _problem_text(text: str, tests: list[str]) -> str:
    asserts = "\n".join(tests)
    return f"{text}\nYour code should pass these tests:\n\n```python\n{asserts}\n```"


def _fenced(code: str) -> str:
    return f"```python\n{code.strip()}\n```"


@register_benchmark("mbpp")
class MBPP(Benchmark):
    layout = ("mbpp/mbpp.jsonl: the original google-research release, one JSON object per line with text, code, "
              "task_id, test_setup_code, test_list, challenge_test_list (test split: task ids 11-510, few-shot: 2-4)")
    gen = REASONING_GEN

    def load(self, data_dir: Path, shots: int = 0, max_samples: int = 0, **options: Any) -> list[dict]:
        path = self.require(Path(data_dir) / "mbpp" / "mbpp.jsonl")
        check_shots(self.name, shots, len(FEWSHOT_IDS), "MBPP's few-shot split (task ids 2-4)")
        items = sorted(map(_parts, read_jsonl(path)), key=lambda item: item[0])
        examples = [(_problem_text(text, tests), _fenced(code)) for problem_id, text, code, tests, _ in items
                    if problem_id in FEWSHOT_IDS][:shots]
        if len(examples) < shots:
            raise ValueError(f"{self.name}: {shots} shots requested but {path} has only {len(examples)} "
                             f"of task ids 2-4")
        rows = []
        for problem_id, text, code, tests, setup in items:
            if problem_id in TEST_IDS:
                question = fewshot_prompt(examples, f"{_problem_text(text, tests)}\n\n{INSTRUCTION}")
                asserts = "\n".join(tests)
                # the setup code (imports the reference solutions lean on) runs on both sides of the sandbox
                answer = json.dumps({"tests": asserts, "setup": setup}) if setup.strip() else asserts
                rows.append({"id": str(problem_id), "question": question, "answer": answer,
                             "reference": _fenced(code)})
        check_unique_ids(rows, str(path))
        return take(rows, max_samples)

    def grade(self, row: dict, response: str) -> float:
        from dare_core.rewards import compute_reward

        return float(compute_reward("code", response, row["answer"]).acc)
