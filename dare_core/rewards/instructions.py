"""The answer-format instruction each task's reward needs in its prompt (docs/algorithms.md#rewards).

A reward can only grade what it can parse: a math prompt that never asks for `\\boxed{}` makes whole
RL groups score 0 (advantage 0, no learning). Data preparation therefore
- appends `INSTRUCTIONS[task]` to raw (`source`) prompts of a task that lack its marker, and
- checks with `check_rows` that every RL and eval row carries one of `REQUIRED_MARKERS[task]`.
Synthetic tasks write their own format into prompt and ground truth, so they need no entry.
"""
from __future__ import annotations

from typing import Iterable

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# task -> instruction appended to a raw prompt that lacks every marker of the task
INSTRUCTIONS: dict[str, str] = {"math": BOXED_INSTRUCTION, "gsm8k": BOXED_INSTRUCTION}
# task -> substrings of which a prompt must contain at least one (the formats its reward parses)
REQUIRED_MARKERS: dict[str, tuple[str, ...]] = {
    "math": ("\\boxed",),
    "gsm8k": ("\\boxed", "<answer>"),
}


def has_instruction(task: str, prompt: str) -> bool:
    markers = REQUIRED_MARKERS.get(task)
    return markers is None or any(marker in prompt for marker in markers)


def add_instruction(task: str, prompt: str) -> str:
    """`prompt` with the task's instruction appended, unless it already names the answer format."""
    if task not in INSTRUCTIONS or has_instruction(task, prompt):
        return prompt
    return prompt.rstrip() + "\n" + INSTRUCTIONS[task]


def check_rows(rows: Iterable[dict], split: str) -> None:
    """Raise ValueError at the first row whose prompt lacks the instruction its task's reward needs."""
    for index, row in enumerate(rows):
        task = row.get("task", "")
        if not has_instruction(task, row.get("prompt", "")):
            where = row.get("_where", f"{split} row {index + 1}")
            raise ValueError(f"{where}: the {split} prompt of task '{task}' does not ask for the answer format "
                             f"its reward parses (one of {list(REQUIRED_MARKERS[task])}); e.g. append "
                             f"{INSTRUCTIONS[task]!r}")
