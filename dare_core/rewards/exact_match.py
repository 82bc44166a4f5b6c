"""`exact_match`: the whole response equals the ground truth after normalisation.

Options (rl.reward_args): `strip` (true: leading/trailing whitespace is ignored), `case` (true:
case-sensitive; false lowercases both sides), `whitespace` (`keep`; `collapse`: every run of
whitespace reads as one space; `remove`: whitespace is ignored). Nothing else is normalised: "+1225"
and "01225" do not match "1225" (the `numeric` reward compares numbers). An empty response (after
normalisation) scores 0 with `extra["extraction_failed"]`.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.options import flag, one_of
from dare_core.rewards.registry import ground_truth_check, register_reward

_RUN = re.compile(r"\s+")
WHITESPACE: dict[str, Callable[[str], str]] = {
    "keep": lambda text: text,
    "collapse": lambda text: _RUN.sub(" ", text),
    "remove": lambda text: _RUN.sub("", text),
}


def normalize(text: str, strip: bool = True, case: bool = True, whitespace: str = "keep") -> str:
    """`text` as exact_match compares it under these options."""
    text = WHITESPACE[one_of("exact_match", "whitespace", whitespace, WHITESPACE)](text)
    if flag("exact_match", "strip", strip):
        text = text.strip()
    return text if flag("exact_match", "case", case) else text.lower()


@ground_truth_check("exact_match")
def check_ground_truth(ground_truth: str, strip: bool = True, case: bool = True, whitespace: str = "keep") -> str:
    target = normalize(ground_truth, strip, case, whitespace)
    if not target:
        raise ValueError(f"exact_match reward: ground truth {ground_truth!r} is empty after normalisation "
                         f"(strip={strip}, whitespace={whitespace!r})")
    return target


@register_reward("exact_match")
def exact_match_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None, *, strip: bool = True,
                       case: bool = True, whitespace: str = "keep") -> RewardResult:
    target = check_ground_truth(ground_truth, strip, case, whitespace)
    pred = normalize(response_text, strip, case, whitespace)
    if not pred:
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    correct = float(pred == target)
    return RewardResult(correct, correct, pred, {})
