"""`choice`: multiple choice; the ground truth is one option letter, the response must choose it.

The chosen letter is, in this order: the whole response when it is one letter, possibly wrapped
("B", "(B)", "B.", "**B**"); else the last statement "answer: B" / "the answer is (B)" (the letter
uppercase, so the article in "the answer is a ..." is not read as A); else a letter opening the
response with a delimiter ("B. Paris", "(B) Paris"). Only letters among the options count.
Option (rl.reward_args): `letters`, the option letters (default A-Z). A response choosing none scores
0 with `extra["extraction_failed"]`.
"""
from __future__ import annotations

import re
import string
from typing import Optional

from dare_core.rewards.base import RewardError, RewardResult
from dare_core.rewards.registry import ground_truth_check, register_reward

ALL_LETTERS = string.ascii_uppercase
_WRAPPED = re.compile(r"[\s*_(\[]*([A-Za-z])[\s*_)\].:]*")
# possessive (`*+`, `++`): "answer" followed by 50 K spaces must not be retried split by split
_STATEMENT = re.compile(r"(?i:answer)(?:\s++(?i:is))?\s*+(?::\s*+)?(?:(?i:option)\s++)?[*_(\[]*+([A-Z])(?![A-Za-z0-9])")
_LEADING = re.compile(r"\s*[*_]*[(\[]?([A-Z])(?:[)\].:][*_]*)(?:\s|$)")


def _letters(letters: str) -> str:
    if (not isinstance(letters, str) or not letters or len(set(letters)) != len(letters)
            or any(c not in ALL_LETTERS for c in letters)):
        raise RewardError(f"choice reward: option letters must be distinct uppercase letters A-Z, e.g. 'ABCD', "
                         f"got {letters!r}")
    return letters


@ground_truth_check("choice")
def parse_ground_truth(ground_truth: str, letters: str = ALL_LETTERS) -> str:
    allowed = _letters(letters)
    answer = ground_truth.strip().upper()
    if len(answer) != 1 or answer not in allowed:
        raise ValueError(f"choice reward: ground truth {ground_truth!r} is not one of the option letters {allowed!r}")
    return answer


def chosen_letter(text: str, letters: str = ALL_LETTERS) -> Optional[str]:
    """The option letter the response chooses; None if it chooses none of `letters`."""
    whole = _WRAPPED.fullmatch(text)
    if whole and whole.group(1).upper() in letters:
        return whole.group(1).upper()
    stated = [m.group(1) for m in _STATEMENT.finditer(text) if m.group(1) in letters]
    if stated:
        return stated[-1]
    leading = _LEADING.match(text)
    if leading and leading.group(1) in letters:
        return leading.group(1)
    return None


@register_reward("choice")
def choice_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None, *,
                  letters: str = ALL_LETTERS) -> RewardResult:
    target = parse_ground_truth(ground_truth, letters)
    pred = chosen_letter(response_text, letters)
    if pred is None:
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    correct = float(pred == target)
    return RewardResult(correct, correct, pred, {})
