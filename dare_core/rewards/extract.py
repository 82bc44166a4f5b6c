"""Answer extraction shared by the rewards: boxed expressions, `<answer>` tags, fenced code blocks.

Responses are untrusted text of any length, so every scan here is linear in its input (brace
matching from one table, fences line by line, tags with `str.find`), and a response is read from its
last SCAN_CHARS characters only: answers come at the end, and the cut bounds the work per response.
A box, tag or fence that opens before the cut is not seen.
"""
from __future__ import annotations

import bisect
import re
from typing import Optional

# 64 K characters: far beyond a generated response's answer tail (16 K tokens of text and more)
SCAN_CHARS = 1 << 16

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN = re.compile(r"[^\s$]+")
_BRACE = re.compile(r"[{}]")
# fence lines: ``` or ~~~ with an optional info string (the language), and a bare closing fence
_FENCE_OPEN = re.compile(r"[ \t]*(```|~~~)[ \t]*([^\n`]*)")
_FENCE_CLOSE = re.compile(r"[ \t]*(```|~~~)[ \t]*")
_PYTHON_LANGS = {"", "python", "py", "python3", "py3"}


def tail(text: str) -> str:
    """The part of a response that the extractors read: its last SCAN_CHARS characters."""
    return text if len(text) <= SCAN_CHARS else text[-SCAN_CHARS:]


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


def _closing_braces(text: str) -> dict[int, int]:
    """{index of "{": index of its matching "}"} for every balanced group, in one pass."""
    pairs, stack = {}, []
    for match in _BRACE.finditer(text):
        if match.group() == "{":
            stack.append(match.start())
        elif stack:
            pairs[stack.pop()] = match.start()
    return pairs


def last_boxed(text: str) -> Optional[str]:
    """Content of the last top-level `\\boxed{...}` or `\\fbox{...}`, nested braces kept; None if none.

    Also accepts the brace-less `\\boxed 5` form. An unbalanced box is skipped.
    """
    text = tail(text)
    found, pos, pairs = None, 0, None
    while (match := _BOX_COMMAND.search(text, pos)) is not None:
        rest = match.end()
        while rest < len(text) and text[rest] == " ":
            rest += 1
        if rest < len(text) and text[rest] == "{":
            if pairs is None:
                pairs = _closing_braces(text)
            close = pairs.get(rest)
            if close is None:
                pos = match.end()
                continue
            found, pos = text[rest + 1:close], close + 1
            continue
        token = _BARE_TOKEN.match(text, rest)
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
    """Content of the last complete `<answer>...</answer>` (not stripped); None if there is none.
    Tags pair up left to right, each `<answer>` with the first `</answer>` after it."""
    text, found, pos = tail(text), None, 0
    while (start := text.find("<answer>", pos)) >= 0:
        end = text.find("</answer>", start + 8)
        if end < 0:  # no later tag can close either
            break
        found, pos = text[start + 8:end], end + 9
    return found


def python_blocks(text: str) -> list[str]:
    """Bodies of the fenced blocks tagged as Python (or untagged), in order, in linear time.

    A fence line (``` or ~~~, optionally indented, with an info string) opens a block that the next
    bare fence line of the same kind closes; an opening fence that is never closed is not a block."""
    lines = text.split("\n")
    closers: dict[str, list[int]] = {"```": [], "~~~": []}
    for i, line in enumerate(lines):
        if (close := _FENCE_CLOSE.fullmatch(line)) is not None:
            closers[close.group(1)].append(i)
    blocks, i = [], 0
    while i < len(lines) - 1:  # an opening fence needs a line after it
        opening = _FENCE_OPEN.fullmatch(lines[i])
        if opening is None:
            i += 1
            continue
        after = closers[opening.group(1)]
        k = bisect.bisect_right(after, i)
        if k == len(after):
            i += 1
            continue
        end = after[k]
        info = opening.group(2).strip()
        if (info.lower().split(" ")[0] if info else "") in _PYTHON_LANGS:
            blocks.append("".join(line + "\n" for line in lines[i + 1:end]))
        i = end + 1
    return blocks


def last_code_block(text: str) -> Optional[str]:
    """Body of the last fenced block tagged as Python (or untagged); None if there is none."""
    blocks = python_blocks(tail(text))
    return blocks[-1] if blocks else None


def extract_code(text: str) -> str:
    """The last fenced Python block, else the whole text (completion-style prompts such as HumanEval)."""
    block = last_code_block(text)
    return block if block is not None else text
