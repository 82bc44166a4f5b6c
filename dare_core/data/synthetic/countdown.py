"""Countdown: combine the given numbers with + - * / and parentheses to reach the target.

Each row draws `num_numbers` numbers from `min_number..max_number`, then a target uniformly among the
values reachable with every number used exactly once, where every intermediate result is a
non-negative integer (division only when exact) and the target is in `1..max_target`; the response
is a shortest such expression (fewest parentheses). Graded by the `countdown` reward.

Format contract:
- prompt: the numbers in drawing order and the target, `"1 2 3 -> 9"`; with `instruction`, one short
  line follows saying how to answer;
- `answer_format="tag"` (default): response `<answer>(1+2)*3</answer>`, the reward reads the last tag;
- `answer_format="plain"`: response `(1+2)*3`, the whole response is the answer. Terse enough for
  the char-level embedded model, whose answer canvas is a few dozen characters;
- ground truth: `"<target>|<n1>,<n2>,...[|plain]"` (see `dare_core.rewards.countdown`), so the reward
  parses the format the prompt asked for.
"""
from __future__ import annotations

import random
from fractions import Fraction
from itertools import product
from typing import Optional

from dare_core.data.synthetic.registry import register_task
from dare_core.rewards.countdown import FORMATS, evaluate, format_ground_truth

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_INSTRUCTIONS = {
    "tag": "Use each number once with + - * /. Answer as <answer>expression</answer>.",
    "plain": "Use each number once with + - * /. Answer with the expression only.",
}
# num_distinct enumerates problems only up to this many number tuples.
_MAX_ENUMERATED = 100_000


def _check_args(num_numbers: int, min_number: int, max_number: int, ops: str, answer_format: str,
                max_target: Optional[int]) -> None:
    if not 2 <= num_numbers <= 6:
        raise ValueError(f"countdown: num_numbers must be in 2..6, got {num_numbers}")
    if not 0 <= min_number <= max_number or max_number < 1:
        raise ValueError(f"countdown: need 0 <= min_number <= max_number, max_number >= 1; got {min_number}, "
                         f"{max_number}")
    if not ops or any(op not in _PRECEDENCE for op in ops):
        raise ValueError(f"countdown: ops must be a non-empty subset of '+-*/', got {ops!r}")
    if answer_format not in FORMATS:
        raise ValueError(f"countdown: answer_format must be one of {FORMATS}, got {answer_format!r}")
    if max_target is not None and max_target < 1:
        raise ValueError(f"countdown: max_target must be >= 1, got {max_target}")


def _render(op: str, left: tuple[str, Optional[str]], right: tuple[str, Optional[str]]) -> str:
    """`left op right`, with parentheses only where precedence needs them."""
    (left_text, left_op), (right_text, right_op) = left, right
    if left_op is not None and _PRECEDENCE[left_op] < _PRECEDENCE[op]:
        left_text = f"({left_text})"
    if right_op is not None and (_PRECEDENCE[right_op] < _PRECEDENCE[op]
                                 or (_PRECEDENCE[right_op] == _PRECEDENCE[op] and op in "-/")):
        right_text = f"({right_text})"
    return f"{left_text}{op}{right_text}"


def _combine(op: str, a: int, b: int) -> Optional[int]:
    if op == "+":
        return a + b
    if op == "-":
        return a - b if a >= b else None
    if op == "*":
        return a * b
    return a // b if b != 0 and a % b == 0 else None


def reachable(numbers: tuple[int, ...], ops: str) -> dict[int, str]:
    """value -> a shortest expression using every number exactly once (non-negative integer steps)."""
    n = len(numbers)
    # best[mask] maps a value to (expression, top operator) over the numbers in `mask`
    best: dict[int, dict[int, tuple[str, Optional[str]]]] = {}
    for i, number in enumerate(numbers):
        best.setdefault(1 << i, {})[number] = (str(number), None)
    for mask in range(1, 1 << n):
        if mask & (mask - 1) == 0:
            continue
        values: dict[int, tuple[str, Optional[str]]] = {}
        sub = (mask - 1) & mask
        while sub:
            rest = mask ^ sub
            for (a, left), (b, right) in product(best[sub].items(), best[rest].items()):
                for op in ops:
                    value = _combine(op, a, b)
                    if value is None:
                        continue
                    text = _render(op, left, right)
                    if value not in values or len(text) < len(values[value][0]):
                        values[value] = (text, op)
            sub = (sub - 1) & mask
        best[mask] = values
    return {value: text for value, (text, _) in best[(1 << n) - 1].items()}


def _targets(numbers: tuple[int, ...], ops: str, max_target: Optional[int], cache: dict) -> dict[int, str]:
    key = tuple(sorted(numbers))
    if key not in cache:
        cache[key] = {value: text for value, text in reachable(key, ops).items()
                      if value >= 1 and (max_target is None or value <= max_target)}
    return cache[key]


@register_task("countdown")
class CountdownTask:
    reward = "countdown"

    def generate(self, n: int, seed: int, num_numbers: int = 3, min_number: int = 1, max_number: int = 9,
                 ops: str = "+-*/", max_target: Optional[int] = None, answer_format: str = "tag",
                 instruction: bool = True) -> list[dict]:
        _check_args(num_numbers, min_number, max_number, ops, answer_format, max_target)
        rng = random.Random(seed)
        cache: dict = {}
        rows, misses = [], 0
        while len(rows) < n:
            numbers = tuple(rng.randint(min_number, max_number) for _ in range(num_numbers))
            targets = _targets(numbers, ops, max_target, cache)
            if not targets:  # e.g. only zeros, or nothing <= max_target: draw again
                misses += 1
                if misses > 10_000:
                    raise ValueError(f"countdown: almost no draw reaches a target in 1..{max_target}")
                continue
            target = rng.choice(sorted(targets))
            expression = targets[target]
            assert evaluate(expression) == Fraction(target)
            prompt = f"{' '.join(map(str, numbers))} -> {target}"
            if instruction:
                prompt += "\n" + _INSTRUCTIONS[answer_format]
            response = f"<answer>{expression}</answer>" if answer_format == "tag" else expression
            rows.append({"prompt": prompt, "response": response,
                         "ground_truth": format_ground_truth(target, list(numbers), answer_format),
                         "task": self.name})
        return rows

    def num_distinct(self, num_numbers: int = 3, min_number: int = 1, max_number: int = 9, ops: str = "+-*/",
                     max_target: Optional[int] = None, answer_format: str = "tag",
                     instruction: bool = True) -> Optional[int]:
        """Distinct prompts (ordered numbers x reachable target); None when too many to enumerate."""
        _check_args(num_numbers, min_number, max_number, ops, answer_format, max_target)
        span = max_number - min_number + 1
        if span ** num_numbers > _MAX_ENUMERATED:
            return None
        cache: dict = {}
        return sum(len(_targets(numbers, ops, max_target, cache))
                   for numbers in product(range(min_number, max_number + 1), repeat=num_numbers))
