"""The process that runs a user's `module:function` reward (and its `validate`) for user_host.py.
Run as `python -c <this file's text> module:function`, so that only the standard library and the
user's module are imported (no dare_core package, and no folder of this file on sys.path).

Protocol on stdin/stdout (stdout is kept for it alone: the user's prints go to stderr): frames of a
4-byte big-endian length and a pickle. The parent's first frame is its sys.path; this process answers
("ready", None) once the function is imported (or ("error", ...)); then each ("call" | "validate",
args, kwargs) is answered ("ok", value) or ("error", (type name, message, is a ValueError)).
It ends at the end of its input (the parent closed it, or died), and within a second of its parent's
death while the user's code runs."""
import importlib
import os
import pickle
import struct
import sys
import threading
import time

_IN = os.fdopen(0, "rb", buffering=0)
_OUT = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
sys.stdout = sys.stderr


def _recv():
    head = _IN.read(4)
    while head is not None and 0 < len(head) < 4:
        more = _IN.read(4 - len(head))
        if not more:
            return None
        head += more
    if not head:
        return None
    size, data = struct.unpack(">I", head)[0], b""
    while len(data) < size:
        chunk = _IN.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return pickle.loads(data)


def _send(message) -> None:
    try:
        data = pickle.dumps(message)
    except Exception as exc:  # an answer that cannot travel (an open file, a lambda, ...)
        data = pickle.dumps(("error", ("TypeError", f"returned a value that cannot be passed on: {exc}", False)))
    _OUT.write(struct.pack(">I", len(data)) + data)
    _OUT.flush()


def _watch_parent(parent: int) -> None:
    # the parent's death closes this process's input, but the user's code may never read it again
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _error(exc: BaseException):
    return "error", (type(exc).__name__, str(exc), isinstance(exc, ValueError))


def main() -> None:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    paths = _recv()
    if paths is None:
        return
    sys.path[:] = paths
    module_name, _, attr = sys.argv[1].partition(":")
    try:
        fn = importlib.import_module(module_name)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which names the reward)
        _send(_error(exc))
        return
    _send(("ready", None))
    while True:
        request = _recv()
        if request is None:
            return
        kind, args, kwargs = request
        try:
            value = (fn if kind == "call" else fn.validate)(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            _send(_error(exc))
            continue
        _send(("ok", value))


main()
