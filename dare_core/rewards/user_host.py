"""A user's `module:function` reward runs in a process of its own, under a time limit: a function
that never returns (an endless loop, a wait on the network, a regular expression that backtracks for
ever) would otherwise hang `prepare` (which calls its `validate` on every ground truth) or an RL step
for ever, and no signal can stop C code on the thread that runs it, nor any code on another thread.

One host process per reference (`_user_child.py`), started at the first call and kept: a call costs
a round trip on a pipe (tens of microseconds). A call that outlives `DARE_USER_CODE_TIMEOUT_S`
seconds (default 60) kills the host, which the next call starts again, and raises `UserCodeTimeout`
naming the function. Calls from several threads take turns (the user's code was never assumed to be
thread-safe). The host ends with this process: at the end of its input, or within a second of this
process's death while the user's code runs."""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from dare_core.errors import UserError

TIMEOUT_ENV = "DARE_USER_CODE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
# importing the user's module may take long (it may import torch): its own allowance, on top
STARTUP_S = 60.0
_CHILD = (Path(__file__).with_name("_user_child.py")).read_text(encoding="utf-8")


class UserCodeTimeout(UserError):
    """The user's function did not return within `limit` seconds (its host was killed)."""

    def __init__(self, reference: str, limit: float, what: str):
        where = f" {what}" if what else ""
        super().__init__(f"reward {reference!r} did not return within {limit:g} s{where} (the limit: ${TIMEOUT_ENV}); "
                         f"it was stopped")
        self.limit = limit


class UserCodeFailed(Exception):
    """The user's function raised: its exception's type name and message, and whether it was a
    ValueError (a `validate` rejecting a ground truth)."""

    def __init__(self, type_name: str, message: str, value_error: bool):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.value_error = type_name, message, value_error


def time_limit() -> float:
    """Seconds a call of the user's code may take: $DARE_USER_CODE_TIMEOUT_S, else 60."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise UserError(f"${TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


class _Host:
    def __init__(self, reference: str):
        self.reference = reference
        self.lock = threading.Lock()
        self.proc: Optional[subprocess.Popen] = None

    def _send(self, message: Any) -> None:
        data = pickle.dumps(message)
        view = memoryview(struct.pack(">I", len(data)) + data)
        while view:  # (the host reads while it waits for a request: a large row does not block for good)
            view = view[os.write(self.proc.stdin.fileno(), view):]

    def _read(self, size: int, deadline: float) -> Optional[bytes]:
        """`size` bytes from the host, or None at the deadline; EOFError where it ended."""
        fd, buf = self.proc.stdout.fileno(), b""
        while len(buf) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, size - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _receive(self, deadline: float) -> Optional[tuple]:
        head = self._read(4, deadline)
        if head is None:
            return None
        body = self._read(struct.unpack(">I", head)[0], deadline)
        return None if body is None else pickle.loads(body)

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
            self.proc = None

    def _exchange(self, message: Any, limit: float, what: str) -> tuple:
        deadline = time.monotonic() + limit
        try:
            self._send(message)
            reply = self._receive(deadline)
        except (EOFError, BrokenPipeError):
            code = self.proc.wait()
            self._kill()
            raise UserCodeFailed("SystemExit", f"the process running it ended (exit code {code}) {what}".strip(),
                                 False) from None
        except BaseException:  # (Ctrl-C mid-call): its answer would be read as the next call's
            self._kill()
            raise
        if reply is None:
            self._kill()
            raise UserCodeTimeout(self.reference, limit, what)
        return reply

    def _start(self, limit: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, self.reference], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)
        kind, payload = self._exchange(list(sys.path), limit + STARTUP_S, "while its module was imported")
        if kind != "ready":
            self._kill()
            raise UserCodeFailed(*payload)

    def call(self, kind: str, args: tuple, kwargs: dict, what: str) -> Any:
        limit = time_limit()
        with self.lock:
            if self.proc is not None and self.proc.poll() is not None:
                self._kill()  # it ended since the last call
            if self.proc is None:
                self._start(limit)
            kind_, payload = self._exchange((kind, args, kwargs), limit, what)
        if kind_ == "error":
            raise UserCodeFailed(*payload)
        return payload


_HOSTS: dict[str, _Host] = {}
_HOSTS_LOCK = threading.Lock()


def run_user_code(reference: str, kind: str, args: tuple, kwargs: dict, what: str = "") -> Any:
    """`module:function`'s function (`kind` "call") or its `validate` ("validate") applied to `args`
    and `kwargs` in its host process, under the time limit; `what` says on what, for the message.
    Raises UserCodeTimeout, or UserCodeFailed for an exception of the user's code."""
    with _HOSTS_LOCK:
        host = _HOSTS.setdefault(reference, _Host(reference))
    return host.call(kind, args, kwargs, what)
