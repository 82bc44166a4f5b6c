"""GSM8K reward (ALGORITHMS.md section 7): numeric match of the final answer, tolerance 1e-6.

The prediction is taken in the format the prompt asked for: the last `\\boxed{}`/`\\fbox{}`, else the
last `<answer>...</answer>` (d1 format), else the last number in the text.
"""
from __future__ import annotations

import re
from typing import Optional

from dare_core.rewards.registry import RewardResult, register_reward

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
TOLERANCE = 1e-6


def _braced(text: str, start: int) -> Optional[tuple[str, int]]:
    """Content of the brace group opening at text[start] and the index after it; None if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last top-level `\\boxed{...}` or `\\fbox{...}`, nested braces kept; None if none.

    Also accepts the brace-less `\\boxed 5` form. An unbalanced box is skipped.
    """
    found, pos = None, 0
    while (match := _BOX_COMMAND.search(text, pos)) is not None:
        rest = match.end()
        while rest < len(text) and text[rest] == " ":
            rest += 1
        if rest < len(text) and text[rest] == "{":
            group = _braced(text, rest)
            if group is None:
                pos = match.end()
                continue
            found, pos = group
            continue
        token = re.match(r"[^\s$]+", text[rest:])
        if rest > match.end() and token:
            found = token.group(0)
        pos = match.end()
    return found


def _to_number(text: str) -> Optional[float]:
    cleaned = text.replace(",", "").replace("\\$", "").replace("$", "").strip().rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def _ground_truth_number(ground_truth: str) -> float:
    answer = ground_truth.split("####")[-1]
    value = _to_number(answer)
    if value is None:
        raise ValueError(f"gsm8k reward: ground truth {ground_truth!r} has no number after '####'")
    return value


def _extract(text: str) -> tuple[Optional[str], Optional[str]]:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip(), "boxed"
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip(), "answer_tag"
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1], "last_number"
    return None, None


@register_reward("gsm8k")
def gsm8k_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    target = _ground_truth_number(ground_truth)
    pred, method = _extract(response_text)
    if pred is None:
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    value = _to_number(pred)
    correct = float(value is not None and abs(value - target) <= TOLERANCE)
    return RewardResult(correct, correct, pred, {"method": method})
