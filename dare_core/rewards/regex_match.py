"""`regex_match`: the ground truth is a regular expression (Python `re` syntax) that the whole
stripped response must match (`fullmatch`).

Option `flags`: letters of `re` flags, e.g. "i" (ignore case), "is"; see FLAGS. A response longer
than MAX_RESPONSE_CHARS scores 0 unread (`extra["too_long"]`): a pathological pattern's backtracking
grows with the text it scans. An empty response scores 0 with `extra["extraction_failed"]`.
"""
from __future__ import annotations

import re
from typing import Optional

from dare_core.rewards.base import RewardError, RewardResult
from dare_core.rewards.registry import ground_truth_check, register_reward

MAX_RESPONSE_CHARS = 10_000
FLAGS = {"i": re.IGNORECASE, "s": re.DOTALL, "m": re.MULTILINE, "x": re.VERBOSE, "a": re.ASCII}


def _flags(flags: str) -> int:
    if not isinstance(flags, str):
        raise RewardError(f"regex_match reward: option flags must be a string of {sorted(FLAGS)}, got {flags!r}")
    value = 0
    for letter in flags:
        if letter not in FLAGS:
            raise RewardError(f"regex_match reward: unknown flag {letter!r} in flags {flags!r}; known: {sorted(FLAGS)}")
        value |= FLAGS[letter]
    return value


@ground_truth_check("regex_match")
def compile_ground_truth(ground_truth: str, flags: str = "") -> re.Pattern:
    try:
        return re.compile(ground_truth, _flags(flags))  # `re` keeps recent patterns compiled
    except re.error as exc:
        raise ValueError(f"regex_match reward: ground truth {ground_truth!r} is not a regular expression: {exc}") from None


@register_reward("regex_match")
def regex_match_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None, *,
                       flags: str = "") -> RewardResult:
    pattern = compile_ground_truth(ground_truth, flags)
    pred = response_text.strip()
    if len(pred) > MAX_RESPONSE_CHARS:
        return RewardResult(0.0, 0.0, None, {"too_long": True})
    if not pred:
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    correct = float(pattern.fullmatch(pred) is not None)
    return RewardResult(correct, correct, pred, {})
