"""Math reward (docs/algorithms.md#rewards): the last `\\boxed{}`/`\\fbox{}` against the ground truth.

Extraction: the content of the last box, found by brace matching so nested braces survive. No box:
score 0 with `extra["extraction_failed"]`. A ground truth that itself contains `\\boxed` is unwrapped.

Equivalence, cheapest first:
1. MATH-style normalisation (`\\left`/`\\right`, spaces, `\\!`, units, `$`, `%`, `^\\circ`, `\\dfrac`, `\\frac12`,
   `\\sqrt2`, `a/b`, `x^{2}`, `x = ...`, thousands commas) and string equality; two plain numbers
   (integers, decimals, `\\frac{p}{q}`) are compared exactly as fractions. These decide most answers
   in-process, without SymPy.
2. Otherwise `math_verify` (parse both sides, then verify), in a worker process with a time limit.
   Without `math_verify`, SymPy equality of the normalised expressions, for short expressions with
   at most two unknown letters. A reply that misses the limit kills the worker (restarted on the
   next call) and scores 0 with `extra["timeout"] = True`.

Score and acc are 1 or 0. `extra["timeout"]` (seconds) overrides the per-call limit. A box longer than
MAX_ANSWER_CHARS scores 0 ("too_long"); the box is searched in the response's last
`extract.SCAN_CHARS` characters.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Optional

from dare_core.rewards.base import RewardResult
from dare_core.rewards.extract import braced, last_boxed, unwrap_boxed
from dare_core.rewards.registry import register_reward

DEFAULT_TIMEOUT = 5.0
# Importing SymPy and math_verify in a fresh worker; not counted against the per-call limit.
STARTUP_TIMEOUT = 120.0
_MAX_NUMBER_CHARS = 40
# A longer boxed answer scores 0 unread ("too_long"): MATH-style answers are far shorter, and some
# normalisation steps are quadratic in the answer's length.
MAX_ANSWER_CHARS = 1000
# how math_equal says it could not decide, as a failure reason (RewardResult.extra["failure"])
FAILED_METHODS = {"timeout": "timeout", "error": "crashed", "unavailable": "crashed"}


# ---- normalisation -------------------------------------------------------------------------------

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf)\{([^{}]*)\}")
_TRAILING_UNIT = re.compile(r"^(.*\d.*?)\\(?:text|mbox|mathrm)\{[^{}]*\}$")


def _fix_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`; braced arguments are kept."""
    out, i = [], 0
    while (j := text.find("\\frac", i)) >= 0:
        out.append(text[i:j + 5])
        k = j + 5
        for _ in range(2):
            if k >= len(text) or text[k] == "\\":
                break
            if text[k] == "{":
                group = braced(text, k)
                if group is None:
                    break
                out.append("{" + group[0] + "}")
                k = group[1]
            else:
                out.append("{" + text[k] + "}")
                k += 1
        i = k
    out.append(text[i:])
    return "".join(out)


def normalize_answer(text: str) -> str:
    """A canonical string for MATH-style answers, for string equality."""
    s = text.strip().replace("\n", " ")
    s = re.sub(r"\\[,;:! ]", "", s).replace("~", "")
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\(?:left|right|displaystyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    for _ in range(3):
        stripped = _TRAILING_UNIT.sub(r"\1", s.strip())
        if stripped == s.strip():
            break
        s = stripped
    s = _TEXT_WRAPPER.sub(r"\1", s)
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if re.fullmatch(r"\s*[A-Za-z]\w?\s*", lhs):
            s = rhs
    s = re.sub(r"\\sqrt\s*([0-9A-Za-z])", r"\\sqrt{\1}", s)
    s = _fix_fracs(s)
    s = s.replace(" ", "")
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)
    s = re.sub(r"(?<!\d)\.(\d)", r"0.\1", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    match = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if match:
        s = f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    return s


def as_rational(normalized: str) -> Optional[Fraction]:
    """The exact value of a plain number (integer, decimal, `\\frac{p}{q}`, signed); None otherwise."""
    if len(normalized) > _MAX_NUMBER_CHARS:
        return None
    if re.fullmatch(r"[+-]?\d+(?:\.\d+)?", normalized):
        return Fraction(normalized)
    match = re.fullmatch(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}", normalized)
    if match and int(match.group(3)) != 0:
        value = Fraction(int(match.group(2)), int(match.group(3)))
        return -value if match.group(1) == "-" else value
    return None


# ---- the worker ----------------------------------------------------------------------------------


class _EquivalenceWorker:
    """One long-lived worker process per parent process, killed and restarted on a timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._owner = 0
        self._buffer = b""
        self.math_verify: Optional[bool] = None

    def _start(self) -> bool:
        source = Path(__file__).with_name("_math_worker.py").read_text()
        self._proc = subprocess.Popen(
            [sys.executable, "-s", "-c", source], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=os.path.dirname(sys.executable) or "/", start_new_session=True)
        self._owner, self._buffer = os.getpid(), b""
        line = self._readline(time.monotonic() + STARTUP_TIMEOUT)
        if line is None:
            self.stop()
            return False
        self.math_verify = bool(json.loads(line).get("math_verify"))
        return True

    def _readline(self, deadline: float) -> Optional[bytes]:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or self._owner != os.getpid():
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # before the wait: the group id cannot be reused yet
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def check(self, request: dict, timeout: float) -> dict:
        with self._lock:
            if self._proc is not None and self._owner != os.getpid():
                self._proc = None  # inherited through fork: the parent's worker, not ours
            if self._proc is None or self._proc.poll() is not None:
                self._proc = None
                if not self._start():
                    return {"equal": False, "method": "unavailable"}
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except OSError:
                self.stop()
                return {"equal": False, "method": "unavailable"}
            line = self._readline(time.monotonic() + timeout)
            if line is None:
                died = self._proc.poll() is not None
                self.stop()
                return {"equal": False, "method": "error" if died else "timeout"}
            return json.loads(line)


_WORKER = _EquivalenceWorker()
atexit.register(_WORKER.stop)


def math_equal(pred: str, gold: str, timeout: Optional[float] = None) -> tuple[bool, str]:
    """Whether two answers are equivalent, and how it was decided: "string", "number", "math_verify",
    "sympy", or, scoring False, "too_long", "unparsed", "timeout", "unavailable", "error"."""
    if len(pred) > MAX_ANSWER_CHARS:  # normalisation and the worker are for answers, not essays
        return False, "too_long"
    pred_norm, gold_norm = normalize_answer(pred), normalize_answer(gold)
    if pred_norm == gold_norm:
        return bool(pred_norm), "string"
    a, b = as_rational(pred_norm), as_rational(gold_norm)
    if a is not None and b is not None:
        return a == b, "number"
    if not pred_norm or not gold_norm:
        return False, "string"
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    reply = _WORKER.check({"pred": pred, "gold": gold, "pred_norm": pred_norm, "gold_norm": gold_norm,
                           "timeout": limit}, limit)
    return bool(reply.get("equal")), str(reply.get("method"))


@register_reward("math")
def math_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None) -> RewardResult:
    pred = last_boxed(response_text)
    if pred is None:
        return RewardResult(0.0, 0.0, None, {"extraction_failed": True})
    pred = pred.strip()
    equal, method = math_equal(pred, unwrap_boxed(ground_truth), timeout=(extra or {}).get("timeout"))
    info: dict = {"method": method}
    if method == "timeout":
        info["timeout"] = True
    if method in FAILED_METHODS:
        info["failure"] = FAILED_METHODS[method]
    score = float(equal)
    return RewardResult(score, score, pred, info)
