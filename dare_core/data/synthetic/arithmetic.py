"""Multi-digit integer arithmetic, the embedded default task.

Format contract: the prompt is `"<a><op><b>="` (e.g. `"123+45="`), and the answer is the plain integer,
with no spaces, sign for positives, or text. The prompt is this terse on purpose: the tokenizer is
char-level and the model tiny, so every prompt character costs sequence length. Subtraction keeps
a >= b (operands are swapped when needed), so results are never negative.

`zero_pad` writes operands and answers at a fixed width with leading zeros ("04+57=" -> "061"):
every canvas position then has one meaning (hundreds, tens, units), which is what a small masked
diffusion model, deciding all positions at once, learns quickly. The reward reads the number, so
"061" and "61" both score.

`demo_error_rate` makes the SFT demonstrations imperfect, as human or model-written data are: with
that probability, a demonstration of an addition whose ones column carries forgets the carry
(57+68 is demonstrated as 115). `ground_truth` is always exact, so a reward can teach the model
what its demonstrations got wrong.
"""
from __future__ import annotations

import random

from dare_core.data.synthetic.registry import register_task

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _check_args(min_digits: int, max_digits: int, ops: str) -> None:
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"arithmetic: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"arithmetic: ops must be a non-empty subset of '{''.join(_OPS)}', got {ops!r}")


def _operand_range(digits: int) -> tuple[int, int]:
    # One-digit operands include 0; longer ones have no leading zero.
    return (0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _result_width(max_digits: int, ops: str) -> int:
    return max({"+": max_digits + 1, "-": max_digits, "*": 2 * max_digits}[op] for op in ops)


@register_task("arithmetic")
class ArithmeticTask:
    reward = "arithmetic"

    def generate(self, n: int, seed: int, min_digits: int = 1, max_digits: int = 3,
                 ops: str = "+", demo_error_rate: float = 0.0, zero_pad: bool = False) -> list[dict]:
        _check_args(min_digits, max_digits, ops)
        if not 0.0 <= demo_error_rate <= 1.0:
            raise ValueError(f"arithmetic: demo_error_rate must be in [0, 1], got {demo_error_rate}")
        rng = random.Random(seed)
        rows = []
        for _ in range(n):
            op = rng.choice(ops)
            a = rng.randint(*_operand_range(rng.randint(min_digits, max_digits)))
            b = rng.randint(*_operand_range(rng.randint(min_digits, max_digits)))
            if op == "-" and a < b:
                a, b = b, a
            answer = str(_OPS[op](a, b))
            demo = answer
            # drawn for every row, so the problems do not depend on the error rate
            sloppy = rng.random() < demo_error_rate
            if sloppy and op == "+" and a % 10 + b % 10 >= 10:
                demo = str(int(answer) - 10)
            prompt = f"{a}{op}{b}="
            if zero_pad:
                width = _result_width(max_digits, ops)
                prompt = f"{a:0{max_digits}d}{op}{b:0{max_digits}d}="
                demo, answer = demo.zfill(width), answer.zfill(width)
            rows.append({"prompt": prompt, "response": demo, "ground_truth": answer, "task": self.name})
        return rows

    def num_distinct(self, min_digits: int = 1, max_digits: int = 3, ops: str = "+", demo_error_rate: float = 0.0,
                     zero_pad: bool = False) -> int:
        _check_args(min_digits, max_digits, ops)
        count = _operand_range(max_digits)[1] - _operand_range(min_digits)[0] + 1
        pairs = {"+": count * count, "*": count * count, "-": count * (count + 1) // 2}
        return sum(pairs[op] for op in set(ops))
