"""The result pipe of a jail, read as untrusted data (`dare_core.rewards.sandbox`).

In the stdin/stdout layout the candidate's program runs in the very process that writes the result
message, so it can write to that pipe itself: any bytes, any JSON shape, any size. The trainer
therefore keeps at most `result_cap` bytes of a result pipe, parses what it kept only after a cheap
structural check (a bounded number of JSON values, so a message cannot expand into gigabytes of
Python objects), and accepts exactly the shapes the start-up code writes, with the types it writes.
Anything else is a "malformed" run: a score of 0 with the reason, never an exception.

A forged message of the right shape gains the candidate nothing: it can only claim outputs, and the
caller compares outputs with the expected ones, exactly as it would compare what the program printed.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional, Sequence

from dare_core.rewards.sandbox.jail import SandboxLimits

# JSON escapes a byte of output as at most 6 bytes (`\\u00XX`, or `\\ufffd` for an invalid one; a
# 4-byte character is a 12-byte surrogate pair); errors are at most 500 characters.
_ESCAPE = 6
_ERROR_CHARS = 500
_SLACK = 12 * _ERROR_CHARS + 512
# after its strings are cut out, an honest case entry is ~40 bytes: {"": true, "": null, "": false, "": ""}
_SKELETON_PER_CASE = 96
_SKELETON_BASE = 128
# a JSON string (possessive: linear on any input); what is left is the message's structure
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)


def result_cap(limits: SandboxLimits, cases: Optional[int]) -> int:
    """Bytes of result message an honest start-up code may write: `cases` stdin/stdout entries whose
    output is already cut at `limits.output_bytes`, or (cases None) one short verdict of the tests."""
    return _SLACK + (cases or 0) * (_ESCAPE * limits.output_bytes + _SLACK)


def _clip(error: object) -> Optional[str]:
    return error[:_ERROR_CHARS] if type(error) is str else None


def _case(entry: object, output_chars: int) -> Optional[dict]:
    if type(entry) is not dict:
        return None
    ok, error, truncated, stdout = (entry.get(k) for k in ("ok", "error", "truncated", "stdout"))
    if type(ok) is not bool or type(truncated) is not bool or type(stdout) is not str:
        return None
    if (error is not None and type(error) is not str) or len(stdout) > output_chars:
        return None
    return {"ok": ok, "error": _clip(error), "truncated": truncated, "stdout": stdout}


def _load(raw: bytes, cases: Optional[int]) -> tuple[object, Optional[str]]:
    skeleton = len(_STRING.sub(b'""', raw))
    if skeleton > _SKELETON_BASE + (cases or 0) * _SKELETON_PER_CASE:
        return None, f"result message has too many values ({skeleton} bytes of structure)"
    try:
        return json.loads(raw.decode("utf-8")), None
    except (ValueError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError is a ValueError
        return None, f"result message is not JSON ({type(exc).__name__})"


def parse_verdict(raw: bytes, limits: SandboxLimits, cases: Optional[int]) -> tuple[Optional[dict], Optional[str]]:
    """(message, None) for a well-formed result message, else (None, why). `cases`: the number of
    stdin/stdout inputs, or None for the tests' verdict. The message, rebuilt from checked fields:
    stdin/stdout `{"cases": [{"ok", "error", "truncated", "stdout"}, ...]}` (one per input) or
    `{"cases": [], "error": str}` (the program did not compile); tests `{"ok": bool, "error": str | None}`."""
    if len(raw) > result_cap(limits, cases):
        return None, f"result message over {result_cap(limits, cases)} bytes"
    value, problem = _load(raw, cases)
    if problem is not None:
        return None, problem
    if type(value) is not dict:
        return None, "result message is not a JSON object"
    if cases is None:
        if type(value.get("ok")) is not bool:
            return None, "verdict without a boolean 'ok'"
        return {"ok": value["ok"], "error": _clip(value.get("error"))}, None
    if value.get("phase") == "compile" and value.get("ok") is False and type(value.get("error")) is str:
        return {"cases": [], "error": _clip(value["error"])}, None
    entries = value.get("cases")
    if type(entries) is not list or len(entries) != cases or set(value) != {"cases"}:
        return None, f"result message without exactly {cases} case(s)"
    checked = [_case(entry, limits.output_bytes) for entry in entries]
    if any(entry is None for entry in checked):
        return None, "result message with a malformed case"
    return {"cases": checked}, None


def drain_pipe(fd: int, kept: bytearray, cap: int) -> None:
    """Add to `kept` (up to `cap` bytes) what already sits in pipe `fd`, without waiting. The start-up
    code writes READY before any untrusted code runs, so a jail that started has it there, even when
    the run ended before the jail's pipe was read: without this it would look as if it never started."""
    try:
        os.set_blocking(fd, False)
        while len(kept) < cap:
            chunk = os.read(fd, min(65536, cap - len(kept)))
            if not chunk:
                return
            kept += chunk
    except OSError:  # BlockingIOError: nothing more there
        return


def never_started(jails: Sequence, until, timed_out: bool, flooded: bool):
    """The jail (of `sandbox._Jail`s) that could not be built, if any, else None. Only a jail that
    ended on its own tells: one killed at the deadline, for a flood, or because the tests' jail
    `until` had finished (tests that do not compile need no program) may not have got to READY yet."""
    if timed_out or flooded:
        return None
    if not until.started:
        return until
    return next((j for j in jails if j is not until and not j.started and j.exited_first), None)
