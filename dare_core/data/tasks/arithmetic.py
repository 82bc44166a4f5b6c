"""Multi-digit integer arithmetic, the embedded default task.

Format contract: the prompt is `"<a><op><b>="` (e.g. `"123+45="`), and the answer is the plain integer,
with no spaces, sign for positives, or text. The prompt is this terse on purpose: the tokenizer is
char-level and the model tiny, so every prompt character costs sequence length. Subtraction keeps
a >= b (operands are swapped when needed), so results are never negative.
"""
from __future__ import annotations

import random

from dare_core.data.tasks import register_task

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _check_args(min_digits: int, max_digits: int, ops: str) -> None:
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"arithmetic: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"arithmetic: ops must be a non-empty subset of '{''.join(_OPS)}', got {ops!r}")


def _operand_range(digits: int) -> tuple[int, int]:
    # One-digit operands include 0; longer ones have no leading zero.
    return (0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


@register_task("arithmetic")
class ArithmeticTask:
    reward = "arithmetic"

    def generate(self, n: int, seed: int, min_digits: int = 1, max_digits: int = 3,
                 ops: str = "+") -> list[dict]:
        _check_args(min_digits, max_digits, ops)
        rng = random.Random(seed)
        rows = []
        for _ in range(n):
            op = rng.choice(ops)
            a = rng.randint(*_operand_range(rng.randint(min_digits, max_digits)))
            b = rng.randint(*_operand_range(rng.randint(min_digits, max_digits)))
            if op == "-" and a < b:
                a, b = b, a
            answer = str(_OPS[op](a, b))
            rows.append({"prompt": f"{a}{op}{b}=", "response": answer, "ground_truth": answer,
                         "task": self.name})
        return rows

    def num_distinct(self, min_digits: int = 1, max_digits: int = 3, ops: str = "+") -> int:
        _check_args(min_digits, max_digits, ops)
        count = _operand_range(max_digits)[1] - _operand_range(min_digits)[0] + 1
        pairs = {"+": count * count, "*": count * count, "-": count * (count + 1) // 2}
        return sum(pairs[op] for op in set(ops))
