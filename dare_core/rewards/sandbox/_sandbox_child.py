"""Trusted start-up code of a jailed process: `python -I -S -B -c <this file's text> <uid> <gid>`.

It runs inside the bubblewrap jail that `dare_core.rewards.sandbox` builds, before any untrusted
code: it leaves root for the given unprivileged uid (when the jail was started by root), lowers the
resource limits, reads its job (JSON) from stdin, loads the modules its job carries and plays one of
three roles. The jail holds only the standard library, no `dare_core`: the modules of a role come in
the job (`dare_core.rewards.sandbox.harness`), as source, and are loaded here after the limits are set and
before any untrusted code runs.

- `stdio` (here): run the program once per input as `__main__`, with the input on stdin and fd 1
  captured into a file of the private work dir; report each case's raw output. The parent compares.
- `serve` (`_harness_serve.py`): the candidate's side of a test run. It executes the program as
  module `solution` and answers requests with JSON-encoded values. Everything in that process is
  under the candidate's control, so nothing it sends is trusted: it is data.
- `tests` (`_harness_run.py` and the modules it uses): the tests' side, in a jail of its own that
  never runs candidate code. The tests run there against proxies of the candidate's names, every
  check of theirs runs whatever the earlier ones found, and the verdict is computed at the end.

Messages between `tests` and `serve`: a 4-byte big-endian length, then UTF-8 JSON; `encode` and
`decode` below are the value format of both sides.
"""
import builtins
import io
import json
import os
import resource
import sys
import types

MAX_MESSAGE = 16 << 20
MAX_DEPTH = 64


class ProtocolError(BaseException):
    """The candidate's process sent something that is not a well-formed reply, or went away (the
    tests' side then fails the run at once: `Link`)."""


def leave_root(uid, gid, keyring):
    """Drop to the unprivileged uid/gid (only when the jail started us as root: bubblewrap run by root
    without a user namespace); all capabilities go with uid 0. Then leave the session keyring that
    the jail inherited from the trainer for a new, empty one of our own, and close keyctl for good:
    the seccomp filter left open only `keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)`, for this."""
    import ctypes

    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    if 0 in os.getresuid() or 0 in os.getresgid():
        raise SystemExit("sandbox: still root after dropping privileges")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # after the uid change, so that the new keyring belongs to the jail's uid, not to root. EPERM
    # (an outer seccomp profile, e.g. Docker's default, denies keyctl to every process here) and
    # ENOSYS (a kernel without keys) both mean no keyring is reachable at all: nothing to leave
    if libc.syscall(ctypes.c_long(keyring["keyctl"]), ctypes.c_long(1), ctypes.c_void_p(None)) < 0:
        if ctypes.get_errno() not in (1, 38):
            raise SystemExit(f"sandbox: cannot join a new session keyring (errno {ctypes.get_errno()})")

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = bytes.fromhex(keyring["seal"])
    buffer = ctypes.create_string_buffer(code, len(code))
    program = SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    # prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program); bubblewrap already set no_new_privs
    if libc.prctl(22, 2, ctypes.byref(program), 0, 0) != 0:
        raise SystemExit(f"sandbox: cannot close keyctl (errno {ctypes.get_errno()})")


def set_limits(limits):
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def describe(exc):
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001  (a candidate's __str__ may itself raise)
        text = "?"
    name = type(exc).__name__ if type(type(exc).__name__) is str else "?"
    return (name + (": " + text if text else ""))[:500]


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass


def report(fd, payload):
    """The role's result, then exit at once (no atexit handlers, no further candidate code)."""
    flush()
    try:
        data = json.dumps(payload).encode("utf-8", "backslashreplace")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os._exit(0)


# ---- values on the wire ---------------------------------------------------------------------------

def encode(value, handle, depth=0):
    """JSON-able form of a value: plain values as themselves (exact types only: an int subclass with
    its own __eq__ is not an int), containers tagged, anything else as a handle."""
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is float or kind is str:
        return value
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply to send")
    if kind is list:
        return [encode(item, handle, depth + 1) for item in value]
    if kind is tuple or kind is set or kind is frozenset:
        return {"$": kind.__name__, "v": [encode(item, handle, depth + 1) for item in value]}
    if kind is dict:
        return {"$": "dict", "v": [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in value.items()]}
    if kind is bytes or kind is bytearray:
        return {"$": "bytes", "v": bytes(value).hex()}
    if kind is complex:
        return {"$": "complex", "v": [value.real, value.imag]}
    return handle(value)


_CONTAINERS = {"tuple": tuple, "set": set, "frozenset": frozenset}


def decode(data, reference, depth=0, kinds=_CONTAINERS):
    """The inverse of `encode`; `reference(message)` turns a handle into an object and `kinds` maps
    the tags of tuple, set and frozenset to the types to build. Anything else (an unknown tag, a
    wrong shape) is a ProtocolError."""
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is float or kind is str:
        return data
    if depth > MAX_DEPTH + 1:
        raise ProtocolError("value nested too deeply")
    if kind is list:
        return [decode(item, reference, depth + 1, kinds) for item in data]
    if kind is not dict:
        raise ProtocolError(f"unexpected {kind.__name__} in a message")
    tag, items = data.get("$"), data.get("v")
    if tag == "ref":
        return reference(data)
    if tag in kinds and type(items) is list:
        return kinds[tag](decode(item, reference, depth + 1, kinds) for item in items)
    if tag == "dict" and type(items) is list and all(type(p) is list and len(p) == 2 for p in items):
        return {decode(k, reference, depth + 1, kinds): decode(v, reference, depth + 1, kinds) for k, v in items}
    if tag == "bytes" and type(items) is str:
        return bytes.fromhex(items)
    if tag == "complex" and type(items) is list and len(items) == 2 and all(type(x) in (int, float) for x in items):
        return complex(*items)
    raise ProtocolError(f"unknown value tag {tag!r}")


class Channel:
    def __init__(self, read_fd, write_fd):
        self.read_fd, self.write_fd = read_fd, write_fd

    def send(self, message):
        data = json.dumps(message).encode("utf-8")
        view = memoryview(len(data).to_bytes(4, "big") + data)
        while view:
            view = view[os.write(self.write_fd, view):]

    def _exactly(self, n):
        parts, left = [], n
        while left:
            chunk = os.read(self.read_fd, min(left, 1 << 20))
            if not chunk:
                return None
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def receive(self):
        """The next message, or None at end of file."""
        header = self._exactly(4)
        if header is None:
            return None
        size = int.from_bytes(header, "big")
        if size > MAX_MESSAGE:
            raise ProtocolError(f"message of {size} bytes")
        body = self._exactly(size)
        if body is None:
            return None
        try:
            return json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"malformed message: {describe(exc)}") from None


# ---- role: stdio ----------------------------------------------------------------------------------

def _feed_stdin(data):
    """Point fd 0 (and sys.stdin) at a pipe holding `data`."""
    read_end, write_end = os.pipe()
    if read_end != 0:
        os.dup2(read_end, 0)
        os.close(read_end)
    if len(data) < 60000:  # fits the pipe buffer
        os.write(write_end, data)
        os.close(write_end)
    else:
        import threading

        def pump():
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(write_end, view):]
            except OSError:
                pass
            finally:
                os.close(write_end)

        threading.Thread(target=pump, daemon=True).start()
    return io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")


def run_stdio(job, program):
    cases, cap = [], job["case_output_bytes"]
    saved_stdout = os.dup(1)
    for index, text in enumerate(job["inputs"]):
        path = f"/sandbox/.case{index}.out"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.close(fd)
        sys.stdin = _feed_stdin(text.encode("utf-8"))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
        ok, error = True, None
        try:
            exec(program, {"__name__": "__main__", "__builtins__": builtins})
        except SystemExit as exc:
            if exc.code not in (None, 0):
                ok, error = False, describe(exc)
        except BaseException as exc:  # noqa: BLE001
            ok, error = False, describe(exc)
        try:
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001
            pass
        os.dup2(saved_stdout, 1)
        with open(path, "rb") as f:
            output = f.read(cap + 1)
        os.unlink(path)
        cases.append({"ok": ok, "error": error, "truncated": len(output) > cap,
                      "stdout": output[:cap].decode("utf-8", "replace")})
    return {"cases": cases}


def load_modules(modules):
    """The role's modules from the job (trusted: the parent's), in order, each importable by name
    from those after it. Loaded before any untrusted code runs."""
    for name, source in modules:
        module = types.ModuleType(name)
        module.__file__ = f"/harness/{name}.py"
        sys.modules[name] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)


def main():
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))  # trusted: the parent's
    leave_root(int(sys.argv[1]), int(sys.argv[2]), job["keyring"])
    os.write(job["result_fd"], b"R")  # started: from here on, a missing verdict is the run's failure
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    set_limits(job["limits"])
    os.chdir("/sandbox")

    def leave(code=None):  # `exit()`/`quit()` come from `site`, which -S skips; programs use them
        raise SystemExit(code)

    builtins.exit = builtins.quit = leave
    result_fd, role = job["result_fd"], job["role"]
    load_modules(job.get("harness", ()))
    source, filename = (job["tests"], "/sandbox/tests.py") if role == "tests" else (job["program"], "/sandbox/solution.py")
    with open(filename, "w", encoding="utf-8") as f:  # tracebacks and `inspect.getsource` find the source
        f.write(source)
    # the tests' side rewrites the tests before compiling them (`_harness_rewrite`, which loaded
    # `ast`): it takes their syntax tree
    flags = sys.modules["ast"].PyCF_ONLY_AST if role == "tests" else 0
    try:
        code = compile(source, filename, "exec", flags)
    except BaseException as exc:  # noqa: BLE001  (a syntax error fails the run; it is not a crash)
        if role == "serve":
            Channel(*job["channel"]).send({"error": describe(exc)})
            os._exit(0)
        report(result_fd, {"ok": False, "phase": "compile", "error": describe(exc)})
    if role == "stdio":
        report(result_fd, run_stdio(job, code))
    elif role == "serve":
        sys.modules["_harness_serve"].serve(job, code)
        os._exit(0)
    else:
        report(result_fd, sys.modules["_harness_run"].run_tests(job, code))


main()
