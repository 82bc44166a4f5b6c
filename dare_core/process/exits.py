"""How a process ended, in words: the signal behind an exit status, and which output lines cannot
say why it failed.

A signal reaches us in three spellings, depending on who passed the status on:

- `-N`: Python's subprocess (and DVC, which reports its cmd's `returncode`) for a child that N killed;
- `128+N`: a shell whose child N killed (also `dare stage`, when its worker or launcher was);
- `256-N`: a Python process that ended with `sys.exit(-N)` after a child's `-N` (exit statuses are
  8 bits): the DeepSpeed launcher does this for a rank that a signal killed.

`-N` is certain. The other two are also ordinary exit codes, so only signals that end a process
unasked-for are read from them, and 255 (DVC's and ssh's code for any error) never is.
"""
from __future__ import annotations

import re
import signal
from typing import Optional

# what a user should look at first when a process died of this signal
HINTS = {
    signal.SIGKILL: "out of memory? see dmesg",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code",
    signal.SIGABRT: "a crash in native code, or NCCL's watchdog ending a collective that timed out",
    signal.SIGXCPU: "a CPU time limit, ulimit -t",
}
# the signals worth reading out of a 128+N or 256-N exit status
FATAL = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGILL, signal.SIGABRT, signal.SIGBUS,
                   signal.SIGFPE, signal.SIGKILL, signal.SIGSEGV, signal.SIGPIPE, signal.SIGTERM, signal.SIGXCPU})
_FATAL_NUMBERS = {int(s) for s in FATAL}

# a tqdm bar or a piece of one: `sft:  40%|####      | 4/10 [00:01<00:02, 3.2it/s]`
_PROGRESS = re.compile(r"\d+%\||\d+/\d+ \[\d+:\d+|(?:[0-9.]+|\?)(?:it/s|s/it)\b")


def signal_of(status: int) -> Optional[signal.Signals]:
    """The signal that ended a process whose exit status (as passed on) is `status`; None when the
    status is an ordinary exit code."""
    if status < 0:
        try:
            return signal.Signals(-status)
        except ValueError:
            return None
    if status == 255:
        return None
    for number in (status - 128, 256 - status):
        if number in _FATAL_NUMBERS:
            return signal.Signals(number)
    return None


def killed_by(sig: signal.Signals) -> str:
    """`killed by SIGKILL (out of memory? see dmesg)`: the signal's name and what to check."""
    hint = HINTS.get(sig)
    return f"killed by {sig.name}" + (f" ({hint})" if hint else "")


def is_progress_bar(line: str) -> bool:
    """A progress bar's frame, whole or cut short: never the line that explains a failure."""
    return bool(_PROGRESS.search(line))
