"""`numeric`: the last number in the response equals the ground-truth number within a tolerance.

Numbers: an optional sign (read as a sign only where it does not follow a letter or digit, so "3-5"
is 3 and 5), digits with optional thousands separators ("1,234"), an optional decimal part and an
optional exponent ("1.5e-3"). Close means |pred - truth| <= max(rel_tol * max(|pred|, |truth|),
abs_tol), in exact decimal arithmetic, so large integers are not blurred by float rounding. Options
(rl.reward_args): `rel_tol` (default 0), `abs_tol` (default 1e-9). `pred` is the number as found,
separators removed; a response without a number scores 0 with `extra["extraction_failed"]`.
"""
from __future__ import annotations

import decimal
import re
from decimal import Decimal
from typing import Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.options import non_negative
from dare_core.rewards.registry import ground_truth_check, register_reward

_NUMBER = re.compile(r"(?:(?<![\w.])[+-])?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?")


def _value(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def last_number(text: str) -> Optional[str]:
    """The last number in `text`, separators removed; None if there is none."""
    found = None
    for found in _NUMBER.finditer(text):
        pass
    return None if found is None else found.group(0).replace(",", "")


@ground_truth_check("numeric")
def parse_ground_truth(ground_truth: str, rel_tol: float = 0.0, abs_tol: float = 1e-9) -> Decimal:
    non_negative("numeric", "rel_tol", rel_tol)
    non_negative("numeric", "abs_tol", abs_tol)
    if not _NUMBER.fullmatch(ground_truth.strip()):
        raise ValueError(f"numeric reward: ground truth {ground_truth!r} is not one number")
    return _value(ground_truth.strip())


def close(a: Decimal, b: Decimal, rel_tol: float, abs_tol: float) -> bool:
    if a == b:  # exact, whatever the magnitude
        return True
    try:
        with decimal.localcontext() as ctx:
            ctx.Emax, ctx.Emin = decimal.MAX_EMAX, decimal.MIN_EMIN
            return abs(a - b) <= max(Decimal(rel_tol) * max(abs(a), abs(b)), Decimal(abs_tol))
    except ArithmeticError:  # an exponent beyond Decimal's range: only equal numbers are close
        return False


@register_reward("numeric")
def numeric_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None, *, rel_tol: float = 0.0,
                   abs_tol: float = 1e-9) -> RewardResult:
    target = parse_ground_truth(ground_truth, rel_tol, abs_tol)
    pred = last_number(response_text)
    if pred is None:
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    try:
        value = _value(pred)
    except ArithmeticError:  # an exponent past Decimal's range ("1e" + 4,000 digits): no number it can be
        return RewardResult(0.0, 0.0, pred[:100], {"invalid": "number"})
    correct = float(close(value, target, float(rel_tol), float(abs_tol)))
    return RewardResult(correct, correct, pred, {})
