"""A stage's console output, turned into log lines for Prefect and an error line for its failure.

Workers print progress bars that redraw with `\\r` many times a second and log one line per logged
step. The console gets everything unchanged; Prefect gets only complete lines (a bar's final state,
once, when it ends its line), at most `rate` lines per second with a burst of `burst`, so a chatty
stage cannot flood the API. What the limit drops is counted and reported in one line.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

from dare_core.process.exits import is_progress_bar

# DARE's workers end a failed run with one `error: ...` line (dare_core/workers/common.py)
WORKER_ERROR = re.compile(r"^error: ")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# the last line of a Python traceback: `SomeError: message` (or `pkg.SomeError: ...`)
# DVC's `ERROR: ...` / `WARNING: ...`, and a record of the workers' logging format (`<asctime> LEVEL name: ...`)
STATED_LEVEL = re.compile(r"^(?:(ERROR|WARNING):|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (CRITICAL|ERROR|WARNING) )")
TRACEBACK_END = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Exit): ")


class LineForwarder:
    """Feed it decoded chunks; it calls `emit(line)` for each complete line, rate-limited.

    Thread-safe: stdout and stderr readers share one forwarder (and one budget)."""

    def __init__(self, emit: Callable[[str], None], rate: float = 10.0, burst: int = 50,
                 clock: Callable[[], float] = time.monotonic, watch: Callable[[str], None] | None = None):
        self.emit, self.rate, self.burst, self.clock = emit, rate, burst, clock
        self.watch = watch  # sees every complete line, also those the rate limit keeps from `emit`
        self.tokens = float(burst)
        self.last = clock()
        self.dropped = 0
        self.partial: dict[str, str] = {}
        self.lock = threading.Lock()

    def feed(self, text: str, stream: str = "stdout") -> None:
        with self.lock:
            buf = self.partial.get(stream, "") + text
            *lines, rest = buf.split("\n")
            self.partial[stream] = rest
            for line in lines:
                self._line(line)

    def close(self) -> None:
        with self.lock:
            for stream, rest in self.partial.items():
                if rest.strip():
                    self._line(rest)
            self.partial.clear()
            self._report_dropped()

    def _line(self, raw: str) -> None:
        # a redrawn bar is `\r`-separated frames: the last frame is what the console shows
        line = ANSI.sub("", raw.split("\r")[-1] if raw.strip("\r") else "").rstrip()
        if not line.strip():
            return
        if self.watch is not None:
            self.watch(line)
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.last) * self.rate)
        self.last = now
        # the worker's error line always goes through: it is the reason the task failed
        if self.tokens < 1 and not WORKER_ERROR.match(line):
            self.dropped += 1
            return
        self._report_dropped()
        self.tokens = max(0.0, self.tokens - 1)
        self.emit(line)

    def _report_dropped(self) -> None:
        if self.dropped:
            self.emit(f"... {self.dropped} lines not forwarded (more than {self.rate:g}/s; the worker's console has them)")
            self.dropped = 0


def line_level(line: str) -> int:
    """The log level a stage's output line states: the worker's `error: ...` line, DVC's `ERROR:`
    report, a traceback's last line and a logged ERROR record are errors; DVC's `WARNING:` lines
    and logged WARNING records are warnings."""
    if WORKER_ERROR.match(line) or TRACEBACK_END.match(line):
        return logging.ERROR
    stated = STATED_LEVEL.match(line)
    return logging.getLevelName(stated.group(1) or stated.group(2)) if stated else logging.INFO


def error_line(output_tail: str) -> str:
    """The line that explains a failed stage: the worker's own `error: ...` line if it printed one;
    else, when the stage command failed ("exited with N"), the last line it printed before DVC's
    report (a traceback's last line); else DVC's own `ERROR: ...` line, which is then the cause
    (an output DVC refuses, a lock, a missing dependency). A progress bar's frame never is: a stage
    killed mid-step leaves one as its last output."""
    lines = [ANSI.sub("", ln).strip() for ln in re.split(r"[\r\n]+", output_tail)]
    lines = [ln for ln in lines if ln and (ln.lower().startswith("error") or not is_progress_bar(ln))]
    worker = [ln for ln in lines if WORKER_ERROR.match(ln)]
    if worker:
        return worker[-1]
    dvc = [i for i, ln in enumerate(lines) if ln.startswith("ERROR")]
    if dvc:
        if re.search(r"exited with -?\d+", lines[dvc[0]]):
            before = [ln for ln in lines[:dvc[0]] if not _dvc_chatter(ln)]
            if before:
                return before[-1]
        return lines[dvc[0]]
    return lines[-1] if lines else ""


def dvc_error(output_tail: str) -> str:
    """DVC's last `ERROR: ...` line ("failed to reproduce 'sft': ... exited with 2")."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", output_tail) if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return errors[-1] if errors else (lines[-1] if lines else "")


def _dvc_chatter(line: str) -> bool:
    return line.startswith(("Running stage", "Verifying", "Stage '", "> ", "Updating lock file", "WARNING:"))
