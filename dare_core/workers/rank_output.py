"""What a rank shows of its worker's stderr, and the one line for a rank that lost the others.

torch's C++ side writes its own diagnostics to stderr: log lines in glog's format (`[W1126
22:44:46.123456 4242 ProcessGroupNCCL.cpp:1234] ...`, which torch may prefix with `[rank0]:`),
C++ exceptions with their backtraces (`Exception raised from ...`, `frame #3: ...`), and, when
NCCL's watchdog ends a collective that timed out, `terminate called after throwing ...` before the
process aborts. Users read a page of that as a crash, also at the end of a run that succeeded.
`NativeNoiseFilter` (used by workers/common.py `run_rank`) passes everything else through as it
comes, progress bars included, and holds those blocks back; a watchdog timeout among them becomes
`lost_contact`'s one line. `--debug` shows them all, unfiltered.
"""
from __future__ import annotations

import codecs
import os
import re
from dataclasses import dataclass
from typing import Optional, TextIO

# (torch also prefixes a rank's uncaught Python traceback: "[rank0]: Traceback ...")
RANK_PREFIX = re.compile(r"\[rank\d+\]: ?")
# glog's header: severity, month and day, time ("[W1126 22:44:46"), after torch's rank prefix or not
HEADER = [r"\[", "[EWIF]", *[r"\d"] * 4, " ", r"\d", r"\d", ":", r"\d", r"\d", ":", r"\d", r"\d"]
GLUED_HEADER = re.compile(r"(\[rank\d+\]:)?" + "".join(HEADER))


def _prefix_pattern(tokens: list[str]) -> str:
    """A pattern that matches the first 1..n tokens of `tokens`."""
    out = ""
    for token in reversed(tokens):
        out = f"{token}(?:{out})?" if out else token
    return out


# the start of a header, unfinished: a pipe's read may end anywhere
RANKED_HEADER = [r"\[", "r", "a", "n", "k", r"\d+", r"\]", ":", *HEADER]
HEADER_START = re.compile("(?:" + _prefix_pattern(RANKED_HEADER) + "|" + _prefix_pattern(HEADER) + r")\Z")
# glog's header (severity, month and day, time), torch's C++ backtraces, std::terminate's report of
# an uncaught C++ exception, and Python's own report (faulthandler) of the abort that follows
NOISE = re.compile(r"\[[EWIF]\d{4} \d\d:\d\d:\d\d|Exception raised from |frame #\d+: |terminate called |\s*what\(\): "
                   r"|Fatal Python error: ")
# what follows a noise line and belongs to it: a message's further lines are indented or blank;
# the flight recorder lists the Python stack of a collective that timed out ("#0 all_reduce from
# ..."), faulthandler the threads' stacks
CONTINUATION = re.compile(r"\s|$|#\d+ |(Current thread|Thread) 0x[0-9a-f]+|Extension modules: ")
MARKERS = ("Exception raised from ", "frame #", "terminate called ", "Fatal Python error: ")
FAULTHANDLER = ("Thread 0x", "Current thread 0x", "Extension modules: ")
# NCCL's watchdog names the collective that timed out:
# WorkNCCL(SeqNum=57, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=60000)
WORK_NCCL = re.compile(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+).*?Timeout\(ms\)=(\d+)")
# gloo: "Timed out waiting 10000ms for recv operation to complete"
GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms")


@dataclass(frozen=True)
class Collective:
    """The collective a rank was waiting in when it lost the others, as far as it is known."""

    name: Optional[str] = None  # all_reduce (Python's name), ALLREDUCE (NCCL's)
    seq: Optional[int] = None  # NCCL's sequence number of the collective in the process group
    timeout_s: Optional[float] = None  # how long it waited, where it timed out


def parse_collective(text: str, name: Optional[str] = None) -> Collective:
    """What an error message of NCCL (the watchdog's) or gloo says of the collective that failed;
    `name` where the caller knows it better (the Python function that raised)."""
    nccl = WORK_NCCL.search(text)
    if nccl:
        return Collective(name or nccl.group(2), int(nccl.group(1)), int(nccl.group(3)) / 1000)
    gloo = GLOO_TIMEOUT.search(text)
    return Collective(name, None, int(gloo.group(1)) / 1000 if gloo else None)


def lost_contact(collective: Collective) -> str:
    """The message of a rank whose wait on the others failed (without `error: rank N: `)."""
    what = ""
    if collective.name:
        what = collective.name + (f" (collective #{collective.seq})" if collective.seq is not None else "")
    if collective.timeout_s is not None:
        what = f"{what or 'a collective'} timed out after {collective.timeout_s:g} s (launch.timeout_s); "
    elif what:
        what += " failed; "
    why = "another rank died (its own error line, or the launcher's report, names it) or hangs"
    return f"lost contact with the other ranks: {what}{why}" + ("" if what else " (waited launch.timeout_s)")


def native_error_message(line: str) -> Optional[str]:
    """The message of a held-back line that reports an error (glog's E or F, an uncaught C++
    exception's `what():`), without its header; None for other lines."""
    bare = RANK_PREFIX.sub("", line, count=1)
    logged = re.match(r"\[[EF]\d{4} [^\]]*\] ?(.*)", bare)
    if logged:
        return logged.group(1).strip() or None
    what = re.match(r"\s*what\(\):\s*(.*)", bare)
    return what.group(1).strip() or None if what else None


class NativeNoiseFilter:
    """Feed it a worker's stderr as it comes: it writes everything to `out` at once except the C++
    runtime's diagnostics, which it keeps in `held`. Progress bars rewrite their line after `\\r`
    without ending it, so a line is passed on as soon as its start shows it is not noise."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.held: list[str] = []
        self._line = ""
        self._passing: Optional[bool] = None  # for the current line: pass it on, hold it, undecided
        self._in_block = False  # the last complete line was noise: blank or indented lines follow it
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._last_char = ""

    def pump(self, fd: int) -> None:
        """Filter what is read from `fd` until its end (run in a thread of its own)."""
        while chunk := os.read(fd, 65536):
            self.feed(self._decoder.decode(chunk))
        self.feed(self._decoder.decode(b"", final=True))
        self.close()

    def feed(self, text: str) -> None:
        for piece in re.split(r"([\r\n])", text):
            if piece in ("\r", "\n"):
                self._end_line(piece)
            elif piece:
                self._grow_line(piece)
        self.out.flush()

    def close(self) -> None:
        """The stream ended: what is left of an unfinished line."""
        if self._line or self._passing is not None:
            self._end_line("")
        self.out.flush()

    @property
    def mid_line(self) -> bool:
        """What was passed on ends inside a line (a progress bar's): a line added now would be
        glued to it."""
        return self._last_char not in ("", "\n")

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self._last_char = text[-1]

    def collective_timeout(self) -> Optional[Collective]:
        """The collective that NCCL's watchdog reported timed out, if the held lines have one."""
        for line in self.held:
            if WORK_NCCL.search(line):
                return parse_collective(line)
        return None

    def _grow_line(self, piece: str) -> None:
        if self._passing:
            # C++ writes to the same stderr unaware of a progress bar's unfinished line
            glued = self._glued_header(piece)
            if glued is None:
                self._write(piece)
                return
            self._write(piece[:glued])
            self._line, self._passing, piece = "", None, piece[glued:]
        self._line += piece
        if self._passing is None:
            if self._is_noise(self._line):
                self._passing = False
            elif not self._undecided(self._line):
                self._passing, self._in_block = True, False
                line, self._line = self._line, ""
                self._grow_line(line)

    def _end_line(self, end: str) -> None:
        if self._passing is None:
            self._passing = not self._is_noise(self._line)
            if self._passing:
                self._write(self._line)
        if self._passing:
            self._write(end)
            self._in_block = False
        else:
            self.held.append(self._line)
            self._in_block = True
        self._line, self._passing = "", None

    def _is_noise(self, line: str) -> bool:
        bare = RANK_PREFIX.sub("", line, count=1)
        return bool(NOISE.match(bare) or (self._in_block and CONTINUATION.match(bare)))

    def _undecided(self, line: str) -> bool:
        """Whether the start of a line may still grow into noise."""
        if HEADER_START.match(line):
            return True
        bare = RANK_PREFIX.sub("", line, count=1)
        if self._in_block and (not bare or bare.isspace() or re.fullmatch(r"#\d*", bare)
                               or any(m.startswith(bare) for m in FAULTHANDLER)):
            return True
        # (a marker, then what NOISE needs after it: "frame #12" waits for its colon)
        return any(m.startswith(bare) or bare.startswith(m) for m in MARKERS) or (bare.isspace() and len(bare) < 16)

    @staticmethod
    def _glued_header(piece: str) -> Optional[int]:
        """Where in `piece`, text added to a line already passed on, a glog header starts (or may)."""
        for k in (i for i, c in enumerate(piece) if c == "["):
            if GLUED_HEADER.match(piece, k) or HEADER_START.match(piece, k):
                return k
        return None
