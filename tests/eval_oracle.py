"""Scripted OpenCompass models that check the graders, not a network: `OracleModel` answers every
fixture item with its reference response (and gives the gold option the highest likelihood),
`GarbageModel` answers "zzz qq" (and prefers a wrong option). Both go through the same OpenCompass
path as `DareModel` (dataset configs, inferencers, evaluators); only the network is replaced."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List

from opencompass.models.base import BaseModel
from opencompass.registry import MODELS

from dare_core.eval.configs import BENCHMARKS, get_benchmark
from dare_core.eval.opencompass import DareModel, _messages, role_parser


def _text(prompt: Any) -> str:
    messages = _messages(prompt)
    return messages if isinstance(messages, str) else "\n".join(m["content"] for m in messages)


class _Scripted(DareModel):
    def __init__(self, path: str, data_dir: str, task_data: str = "", **_: Any):
        BaseModel.__init__(self, path=path)
        self.template_parser = role_parser()
        self.overrides = {}
        self.by_question, self.by_context = {}, {}
        for name in BENCHMARKS:
            folder = Path(task_data) if name == "task" else Path(data_dir)
            if name == "task" and not task_data:
                continue
            for row in get_benchmark(name).load(folder):
                self.by_question[row["question"]] = row
                if "context" in row:
                    self.by_context[row["context"]] = row

    def get_token_len(self, prompt: Any) -> int:
        return len(_text(prompt))


@MODELS.register_module()
class OracleModel(_Scripted):
    def generate(self, inputs: List[Any], max_out_len: int, **_: Any) -> List[str]:
        return [self.by_question[_text(p)]["reference"] for p in inputs]

    def loglikelihood(self, contexts: List[Any], continuations: List[str]) -> List[float]:
        out = []
        for ctx, cont in zip(contexts, continuations):
            row = self.by_context[_text(ctx)]
            gold = row["choices"][row["labels"].index(row["answer"])]
            out.append(0.0 if cont == gold else -5.0)
        return out


@MODELS.register_module()
class GarbageModel(_Scripted):
    def generate(self, inputs: List[Any], max_out_len: int, **_: Any) -> List[str]:
        return ["zzz qq" for _ in inputs]

    def loglikelihood(self, contexts: List[Any], continuations: List[str]) -> List[float]:
        out = []
        for ctx, cont in zip(contexts, continuations):
            row = self.by_context[_text(ctx)]
            gold = row["choices"][row["labels"].index(row["answer"])]
            out.append(-5.0 if cont == gold else 0.0)
        return out
