"""GSM8K rewards (docs/algorithms.md#rewards).

`gsm8k`: numeric match of the final answer, tolerance 1e-6. The ground truth is the text after `####`
with commas removed. The prediction is taken in the format the prompt asked for: the last
`\\boxed{}`/`\\fbox{}` (a box that is not a plain number, e.g. `\\frac{24}{2}`, is graded by the math
path), else the last `<answer>...</answer>` (d1 format), else the last number in the text.

`gsm8k_d1`: the d1 reward set for the `<reasoning>...</reasoning><answer>...</answer>` format, the sum of
- correctness 2.0: the `<answer>` content equals the ground-truth answer string exactly;
- integer 0.5: the `<answer>` content is a non-negative integer (ASCII digits);
- strict format 0.5: the whole text is `<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>`,
  optionally followed by one newline;
- soft format 0.5: the text starts with a `<reasoning>...</reasoning>` block followed (after
  whitespace) by an `<answer>...</answer>` block;
- XML count up to 0.5: 0.125 for each of `<reasoning>\\n`, `\\n</reasoning>\\n`, `\\n<answer>\\n`,
  `\\n</answer>` occurring exactly once, minus 0.001 per character after the last `</answer>` (one
  newline right after it is free).
`acc` is 1 when the correctness term is earned. "." in the format patterns matches newlines too, so
multi-line reasoning is well-formed.
"""
from __future__ import annotations

import re
from typing import Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.extract import last_answer_tag, last_boxed
from dare_core.rewards.registry import ground_truth_check, register_reward

__all__ = ["gsm8k_reward", "gsm8k_d1_reward", "last_boxed"]

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
TOLERANCE = 1e-6


def _to_number(text: str) -> Optional[float]:
    cleaned = text.replace(",", "").replace("\\$", "").replace("$", "").strip().rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


@ground_truth_check("gsm8k")
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
    tag = last_answer_tag(text)
    if tag is not None:
        return tag.strip(), "answer_tag"
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
    if value is None and method == "boxed":
        from dare_core.rewards.math import FAILED_METHODS, math_equal

        timeout = (extra or {}).get("timeout")
        equal, how = math_equal(pred, _ground_truth_answer(ground_truth), timeout=timeout)
        correct = float(equal)
        info = {"method": method, "equivalence": how}
        if how in FAILED_METHODS:
            info["failure"] = FAILED_METHODS[how]
        return RewardResult(correct, correct, pred, info)
    correct = float(value is not None and abs(value - target) <= TOLERANCE)
    return RewardResult(correct, correct, pred, {"method": method})


# ---- d1 reward set ---------------------------------------------------------------------------------

_D1_TAGS = ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>")
_D1_SEPARATOR = "\n</reasoning>\n<answer>\n"
_SPACE_THEN_ANSWER = re.compile(r"\s*+<answer>")


# The two format checks are the regular expressions `<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?`
# (whole text) and `<reasoning>.*?</reasoning>\s*<answer>.*?</answer>` (at the start), DOTALL. As
# expressions they retry every `</reasoning>` against the rest of the text (quadratic on a response
# repeating it); these scans decide the same in linear time.
def _d1_strict(text: str) -> bool:
    head = "<reasoning>\n"
    end = "\n</answer>\n" if text.endswith("\n</answer>\n") else "\n</answer>"
    if not text.startswith(head) or not text.endswith(end) or len(text) < len(head) + len(end):
        return False
    return _D1_SEPARATOR in text[len(head):len(text) - len(end)]


def _d1_soft(text: str) -> bool:
    if not text.startswith("<reasoning>"):
        return False
    pos = len("<reasoning>")
    while (close := text.find("</reasoning>", pos)) >= 0:
        answer = _SPACE_THEN_ANSWER.match(text, close + len("</reasoning>"))
        if answer is not None:  # the earliest <answer> leaves the most room for a </answer>
            return text.find("</answer>", answer.end()) >= 0
        pos = close + 1
    return False


def _ground_truth_answer(ground_truth: str) -> str:
    return ground_truth.split("####")[-1].replace(",", "").strip()


def _d1_answer(text: str) -> Optional[str]:
    """Text after the last `<answer>`, up to the next `</answer>` (or the end), stripped; None if no tag."""
    if "<answer>" not in text:
        return None
    return text.rsplit("<answer>", 1)[1].split("</answer>", 1)[0].strip()


def _d1_xml_count(text: str) -> float:
    score = sum(0.125 for tag in _D1_TAGS if text.count(tag) == 1)
    if "</answer>" in text:
        tail = text.rsplit("</answer>", 1)[1]
        score -= 0.001 * len(tail[1:] if tail.startswith("\n") else tail)
    return score


def d1_components(text: str, ground_truth: str) -> dict[str, float]:
    """The five d1 terms for one response (their sum is the `gsm8k_d1` score)."""
    answer = _d1_answer(text)
    return {
        "correctness": 2.0 if answer is not None and answer == _ground_truth_answer(ground_truth) else 0.0,
        "integer": 0.5 if answer is not None and re.fullmatch(r"[0-9]+", answer) else 0.0,
        "strict_format": 0.5 if _d1_strict(text) else 0.0,
        "soft_format": 0.5 if _d1_soft(text) else 0.0,
        "xml_count": _d1_xml_count(text),
    }


@register_reward("gsm8k_d1")
def gsm8k_d1_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    parts = d1_components(response_text, ground_truth)
    answer = _d1_answer(response_text)
    info: dict = dict(parts)
    if answer is None:
        info["extraction_failed"] = True
    correct = 1.0 if parts["correctness"] > 0 else 0.0
    return RewardResult(sum(parts.values()), correct, answer, info)
