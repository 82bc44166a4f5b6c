"""Reward of the `arithmetic` task: the whole response must be the integer answer."""
from __future__ import annotations

import re
from typing import Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.registry import ground_truth_check, register_reward

# ASCII digits only: str.isdigit/int() would also accept other scripts' digits.
_INTEGER = re.compile(r"[+-]?[0-9]+")


@ground_truth_check("arithmetic")
def parse_ground_truth(ground_truth: str) -> int:
    if not _INTEGER.fullmatch(ground_truth.strip()):
        raise ValueError(f"arithmetic reward: ground truth {ground_truth!r} is not an integer")
    return int(ground_truth)


@register_reward("arithmetic")
def arithmetic_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    target = parse_ground_truth(ground_truth)
    pred = response_text.strip()
    if not _INTEGER.fullmatch(pred):
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    correct = float(canonical(pred) == str(target))
    return RewardResult(correct, correct, pred, {})


def canonical(integer: str) -> str:
    """`str(int(integer))` for a matched integer, without int(): Python refuses to convert more than
    4,300 digits, and a response may hold any number of them (it then simply does not match)."""
    sign, digits = ("-", integer[1:]) if integer[0] == "-" else ("", integer.lstrip("+"))
    digits = digits.lstrip("0")
    return sign + digits if digits else "0"
