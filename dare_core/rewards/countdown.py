"""Countdown reward (docs/algorithms.md#rewards): reach the target with each given number exactly once.

Ground truth format (stable): `"<target>|<n1>,<n2>,...[|<format>]"`, e.g. `"9|1,2,3"`.
- `format` is `tag` (the default when omitted): the answer is the content of the last
  `<answer>...</answer>`; a response without one scores 0.
- `plain`: the prompt asked for the bare expression, so the whole (stripped) response is the answer.
The reward parses exactly the format the prompt requested; the synthetic `countdown` task writes the
format into the ground truth, so the choice travels with every row.

The answer must be at most MAX_ANSWER_CHARS long, match `^[\\d+\\-*/().\\s]+$`, and its integers
must be the given numbers as a multiset. It is evaluated by walking its syntax tree (integer
literals, `+ - * /`, unary signs, parentheses), in exact fractions; nothing is ever `eval`-ed.
Scores: 1.0 if `|value - target| < 1e-5`, 0.1 (format score) if an answer is present but invalid or
wrong, 0 if there is no answer.
"""
from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.extract import last_answer_tag
from dare_core.rewards.registry import ground_truth_check, register_reward

FORMAT_SCORE = 0.1
TOLERANCE = 1e-5
FORMATS = ("tag", "plain")
# Longer answers are rejected before parsing (deep nesting is the parser's worst case).
MAX_ANSWER_CHARS = 200
# ASCII digits only: \d would also accept other scripts' digits.
_ALLOWED = re.compile(r"[\d+\-*/().\s]+", re.ASCII)
_INTEGER = re.compile(r"\d+", re.ASCII)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def format_ground_truth(target: int, numbers: list[int], answer_format: str = "tag") -> str:
    if answer_format not in FORMATS:
        raise ValueError(f"countdown: answer_format must be one of {FORMATS}, got {answer_format!r}")
    text = f"{target}|{','.join(str(n) for n in numbers)}"
    return text if answer_format == "tag" else f"{text}|{answer_format}"


@ground_truth_check("countdown")
def parse_ground_truth(ground_truth: str) -> tuple[int, list[int], str]:
    parts = ground_truth.strip().split("|")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        answer_format = parts[2] if len(parts) == 3 else "tag"
        if answer_format not in FORMATS:
            raise ValueError
        return int(parts[0]), [int(n) for n in parts[1].split(",")], answer_format
    except ValueError:
        raise ValueError(f"countdown reward: ground truth {ground_truth!r} is not "
                         f"'target|n1,n2,...[|tag|plain]'") from None


def evaluate(expression: str) -> Optional[Fraction]:
    """Exact value of an arithmetic expression; None if it is anything else or divides by zero."""
    if len(expression) > MAX_ANSWER_CHARS or not _ALLOWED.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        return walk(tree.body)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def uses_numbers(expression: str, numbers: list[int]) -> bool:
    # compared as canonical digit strings: int() refuses numbers of more than 4,300 digits
    found = sorted(n.lstrip("0") or "0" for n in _INTEGER.findall(expression))
    return found == sorted(str(n) for n in numbers)


@register_reward("countdown")
def countdown_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    target, numbers, answer_format = parse_ground_truth(ground_truth)
    answer = response_text if answer_format == "plain" else last_answer_tag(response_text)
    if answer is None or not answer.strip():
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    answer = answer.strip()
    if len(answer) > MAX_ANSWER_CHARS:  # before any int(): a 5,000-digit number is no answer either
        return RewardResult(FORMAT_SCORE, 0.0, answer[:MAX_ANSWER_CHARS], {"invalid": "length"})
    if not _ALLOWED.fullmatch(answer):
        return RewardResult(FORMAT_SCORE, 0.0, answer, {"invalid": "characters"})
    if not uses_numbers(answer, numbers):
        return RewardResult(FORMAT_SCORE, 0.0, answer, {"invalid": "numbers"})
    value = evaluate(answer)
    if value is None:
        return RewardResult(FORMAT_SCORE, 0.0, answer, {"invalid": "expression"})
    if abs(value - target) < TOLERANCE:
        return RewardResult(1.0, 1.0, answer, {})
    return RewardResult(FORMAT_SCORE, 0.0, answer, {"value": float(value)})
