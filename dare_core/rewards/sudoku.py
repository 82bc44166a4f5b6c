"""Sudoku reward (docs/algorithms.md#rewards), for 4x4 puzzles given as 16 digits in row order.

Ground truth format (stable): `"<puzzle>|<solution>[|<format>]"`, e.g.
`"1030000100400200|1234341221434321"`: the puzzle with `0` for the empty cells, then its solution.
- `format` `tag` (the default when omitted): the answer is the last `<answer>...</answer>`; no tag
  scores 0.
- `plain`: the prompt asked for the bare digits, so the whole response is the answer.

The answer's ASCII digits are taken in order, right-padded with `0` or truncated to the grid size.
Score = the fraction of the puzzle's originally empty cells whose digit matches the solution (given
cells are not graded); acc = 1 only when every empty cell is right. An answer without any digit
scores 0 with `extra["extraction_failed"]`; a puzzle without empty cells scores 1 otherwise.
"""
from __future__ import annotations

import math
import re
from typing import Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.extract import last_answer_tag
from dare_core.rewards.registry import ground_truth_check, register_reward

FORMATS = ("tag", "plain")
_DIGITS = re.compile(r"[0-9]")


def format_ground_truth(puzzle: str, solution: str, answer_format: str = "tag") -> str:
    if answer_format not in FORMATS:
        raise ValueError(f"sudoku: answer_format must be one of {FORMATS}, got {answer_format!r}")
    text = f"{puzzle}|{solution}"
    return text if answer_format == "tag" else f"{text}|{answer_format}"


@ground_truth_check("sudoku")
def parse_ground_truth(ground_truth: str) -> tuple[str, str, str]:
    parts = ground_truth.strip().split("|")
    answer_format = parts[2] if len(parts) == 3 else "tag"
    if (len(parts) not in (2, 3) or answer_format not in FORMATS or len(parts[0]) != len(parts[1])
            or math.isqrt(len(parts[0])) ** 2 != len(parts[0])
            or not re.fullmatch(r"[0-9]+", parts[0]) or not re.fullmatch(r"[1-9]+", parts[1])):
        raise ValueError(f"sudoku reward: ground truth {ground_truth!r} is not 'puzzle|solution[|tag|plain]' "
                         f"with digit strings of one square length (16 for 4x4)")
    return parts[0], parts[1], answer_format


@register_reward("sudoku")
def sudoku_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    puzzle, solution, answer_format = parse_ground_truth(ground_truth)
    answer = response_text if answer_format == "plain" else last_answer_tag(response_text)
    if answer is None:
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    size = len(solution)
    found = "".join(_DIGITS.findall(answer))
    if not found:
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    digits = found[:size].ljust(size, "0")
    empty = [i for i, cell in enumerate(puzzle) if cell == "0"]
    if not empty:
        return RewardResult(1.0, 1.0, digits, {})
    right = sum(digits[i] == solution[i] for i in empty)
    score = right / len(empty)
    return RewardResult(score, float(right == len(empty)), digits, {"cells_right": right, "cells_empty": len(empty)})
