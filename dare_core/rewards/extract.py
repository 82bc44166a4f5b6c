"""Answer extraction shared by the rewards: boxed expressions, `<answer>` tags, fenced code blocks.

All functions are pure string scans (no regex backtracking on nested structures), so they stay fast
on long or adversarial responses.
"""
from __future__ import annotations

import re
from typing import Optional

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# ``` or ~~~ fences; the info string (language) is captured, the body is everything up to the closing fence.
_FENCE = re.compile(r"^[ \t]*(```|~~~)[ \t]*([^\n`]*)\n(.*?)^[ \t]*\1[ \t]*$", re.DOTALL | re.MULTILINE)
_PYTHON_LANGS = {"", "python", "py", "python3", "py3"}


def braced(text: str, start: int) -> Optional[tuple[str, int]]:
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
            group = braced(text, rest)
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


def unwrap_boxed(text: str) -> str:
    """A ground truth that itself contains `\\boxed{...}` is reduced to the box content."""
    if "\\boxed" in text or "\\fbox" in text:
        inner = last_boxed(text)
        if inner is not None:
            return inner.strip()
    return text.strip()


def last_answer_tag(text: str) -> Optional[str]:
    """Content of the last complete `<answer>...</answer>` (not stripped); None if there is none."""
    tags = _ANSWER_TAG.findall(text)
    return tags[-1] if tags else None


def last_code_block(text: str) -> Optional[str]:
    """Body of the last fenced block tagged as Python (or untagged); None if there is none."""
    found = None
    for match in _FENCE.finditer(text):
        lang = match.group(2).strip().lower().split(" ")[0] if match.group(2).strip() else ""
        if lang in _PYTHON_LANGS:
            found = match.group(3)
    return found


def extract_code(text: str) -> str:
    """The last fenced Python block, else the whole text (completion-style prompts such as HumanEval)."""
    block = last_code_block(text)
    return block if block is not None else text
