"""Trusted start-up code of a jailed process: `python -I -S -B -c <this file's text> <uid> <gid>`.

It runs inside the bubblewrap jail that `dare_core.rewards.sandbox` builds, before any untrusted
code: it leaves root for the given unprivileged uid (when the jail was started by root), lowers the
resource limits, reads its job (JSON) from stdin and plays one of three roles. Self-contained: the
jail holds only the standard library, no `dare_core`.

- `stdio`: run the program once per input as `__main__`, with the input on stdin and fd 1 captured
  into a file of the private work dir; report each case's raw output. The parent compares outputs.
- `serve`: the candidate's side of a test run. Execute the program as module `solution`, send the
  values of the names the job lists, then answer requests (call this, get that attribute) with
  JSON-encoded values. Everything here is under the candidate's control, so nothing it sends is
  trusted: it is data.
- `tests`: the tests' side, in a jail of its own that never runs candidate code. The tests execute
  here against proxies of the candidate's names, only those its own job lists (the task's choice);
  builtins and modules are its own. A call crosses to the `serve` process and comes back as plain
  values (int, str, list, tuple, dict, ...), and objects that are not plain values come back as
  opaque handles that compare equal only to themselves; the candidate's exceptions come back as
  CandidateError. The first failure ends the run at once, so no later request tells the candidate
  that an earlier answer passed. The verdict is this process's alone.

Messages between `tests` and `serve`: a 4-byte big-endian length, then UTF-8 JSON.
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
# builtin exceptions that steer control flow rather than report an error, never raised in `tests`
# under their own class: a StopIteration ends the tests' map() or next(), an AssertionError passes
# for the tests' own failure, ImportError picks import fallbacks, Warning feeds warning filters.
# BaseExceptions that are not Exceptions (SystemExit, GeneratorExit, ...) are never relayed either.
_NOT_RELAYED = (AssertionError, StopIteration, StopAsyncIteration, ImportError, Warning)


class CandidateError(Exception):
    """An exception of the candidate's process. One of a builtin error class outside _NOT_RELAYED
    arrives as a subclass of both, so that tests expecting it (`except ValueError`) still catch it;
    any other arrives as CandidateError itself, which only `except Exception` catches."""


_RELAYED_CLASSES = {}


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


def decode(data, reference, depth=0):
    """The inverse of `encode`; `reference(message)` turns a handle into an object. Anything else
    (an unknown tag, a wrong shape) is a ProtocolError."""
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is float or kind is str:
        return data
    if depth > MAX_DEPTH + 1:
        raise ProtocolError("value nested too deeply")
    if kind is list:
        return [decode(item, reference, depth + 1) for item in data]
    if kind is not dict:
        raise ProtocolError(f"unexpected {kind.__name__} in a message")
    tag, items = data.get("$"), data.get("v")
    if tag == "ref":
        return reference(data)
    if tag in _CONTAINERS and type(items) is list:
        return _CONTAINERS[tag](decode(item, reference, depth + 1) for item in items)
    if tag == "dict" and type(items) is list and all(type(p) is list and len(p) == 2 for p in items):
        return {decode(k, reference, depth + 1): decode(v, reference, depth + 1) for k, v in items}
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


# ---- role: serve (candidate side) -----------------------------------------------------------------

def serve(job, program):
    channel = Channel(job["channel"][0], job["channel"][1])
    objects = []

    def handle(value):
        objects.append(value)
        return {"$": "ref", "id": len(objects) - 1, "type": str(type(value).__name__)}

    def reference(message):
        index = message.get("id")
        if type(index) is not int or not 0 <= index < len(objects):
            raise ProtocolError("unknown handle")
        return objects[index]

    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        exec(program, module.__dict__)
    except BaseException as exc:  # noqa: BLE001
        channel.send({"error": describe(exc)})
        return
    names = {}
    for name in job["names"]:  # only those the tests may use (the tests' side picks them again)
        if name in module.__dict__:
            value = module.__dict__[name]
            try:
                names[name] = encode(value, handle)
            except BaseException:  # noqa: BLE001  (too deep, or an int too long to print)
                names[name] = handle(value)
    flush()
    channel.send({"names": names})
    while True:
        request = channel.receive()
        if request is None:
            return
        try:
            target = reference({"id": request["target"]})
            if request["op"] == "call":
                args = decode(request["args"], reference)
                kwargs = decode(request["kwargs"], reference)
                value = target(*args, **kwargs)
            else:
                value = getattr(target, request["name"])
            reply = {"value": encode(value, handle)}
        except BaseException as exc:  # noqa: BLE001
            reply = {"raise": {"type": type(exc).__name__, "message": describe(exc)}}
        flush()  # the program's output reaches the caller even when the jail is killed after the tests
        channel.send(reply)


# ---- role: tests (trusted side) -------------------------------------------------------------------

class Remote:
    """A name or value of the candidate's process: it can be called and its attributes read (both
    cross to the other process); it equals only itself."""

    __slots__ = ("_id", "_type", "_link")

    def __init__(self, link, index, type_name):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_id", index)
        object.__setattr__(self, "_type", type_name)

    def __call__(self, *args, **kwargs):
        return self._link.request({"op": "call", "target": self._id, "args": self._link.encode(list(args)),
                                   "kwargs": self._link.encode(dict(kwargs))})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.request({"op": "getattr", "target": self._id, "name": name})

    def __repr__(self):
        return f"<remote {self._type} object>"

    def __bool__(self):
        # its own __bool__ would decide `assert f(x)`: only plain values have a truth value here
        raise TypeError(f"the truth value of a {self._type} object of the program under test is not checked "
                        "(return a plain value)")


class Link:
    """The tests' end of the channel to the candidate's process. Anything but a well-formed reply
    (the process went away, a malformed message, a value that cannot be rebuilt) fails the run at
    once through `fail`, so that no test can catch it and go on."""

    def __init__(self, channel, fail):
        self.channel, self.fail = channel, fail

    def reference(self, message):
        if type(message.get("id")) is not int:
            raise ProtocolError("bad handle")
        return Remote(self, message["id"], str(message.get("type"))[:100])

    def encode(self, value):
        def handle(obj):
            if type(obj) is Remote:
                return {"$": "ref", "id": obj._id}
            raise TypeError(f"cannot pass a {type(obj).__name__} to the program under test (only plain values)")
        return encode(value, handle)

    def receive(self):
        try:
            message = self.channel.receive()
        except (ProtocolError, OSError) as exc:
            self.fail(f"the program under test: {describe(exc)}")
        if type(message) is not dict:
            self.fail("the program under test exited" if message is None else "malformed reply")
        return message

    def value(self, data):
        try:  # an unhashable key or bad hex would be a TypeError/ValueError of the candidate's making
            return decode(data, self.reference)
        except BaseException as exc:  # noqa: BLE001
            self.fail(f"the program under test: {describe(exc)}")

    def request(self, message):
        try:
            self.channel.send(message)
        except OSError as exc:
            self.fail(f"the program under test: {describe(exc)}")
        reply = self.receive()
        if "raise" in reply:
            raise _relayed(reply["raise"])
        return self.value(reply["value"]) if "value" in reply else self.fail("malformed reply")


def _relayed(info):
    name = info.get("type") if type(info) is dict else None
    message = str(info.get("message", ""))[:500] if type(info) is dict else ""
    base = vars(builtins).get(name) if type(name) is str else None
    if isinstance(base, type) and issubclass(base, Exception) and not issubclass(base, _NOT_RELAYED):
        try:
            if name not in _RELAYED_CLASSES:
                _RELAYED_CLASSES[name] = type(name, (CandidateError, base), {})
            return _RELAYED_CLASSES[name](message.split(": ", 1)[-1])
        except Exception:  # noqa: BLE001  (classes that need other arguments, or cannot be combined)
            pass
    return CandidateError(message)


def _fail_fast_result(unittest, fail):
    class FailFast(unittest.TestResult):
        """Ends the run at the first failure, subtests included: no later request reaches the program."""

        def addError(self, test, err):
            fail(f"{test}: {describe(err[1])}")

        addFailure = addError

        def addSubTest(self, test, subtest, err):
            if err is not None:
                fail(f"{subtest}: {describe(err[1])}")

        def addUnexpectedSuccess(self, test):
            fail(f"{test}: unexpected success")

    return FailFast()


def _run_collected(namespace, names, fail):
    """Run what the tests define in pytest or unittest style: `test*` functions, `Test*` classes
    (methods `test*`), and `unittest.TestCase` subclasses (at least one test of theirs must run)."""
    unittest, cases, ran = sys.modules.get("unittest"), False, 0
    for name in names:
        obj = namespace[name]
        if getattr(obj, "__module__", None) != "__main__":  # imported (`from unittest import TestCase`)
            continue
        if name.startswith("test") and type(obj) is types.FunctionType:
            obj()
        elif isinstance(obj, type) and unittest is not None and issubclass(obj, unittest.TestCase):
            result = _fail_fast_result(unittest, fail)
            unittest.defaultTestLoader.loadTestsFromTestCase(obj).run(result)
            cases, ran = True, ran + result.testsRun
        elif isinstance(obj, type) and name.startswith("Test"):
            instance = obj()
            for attribute in sorted(dir(obj)):
                if attribute.startswith("test") and callable(getattr(instance, attribute)):
                    getattr(instance, attribute)()
    if cases and not ran:
        fail("no unittest test ran")


def run_tests(job, tests):
    import importlib

    def fail(error):  # at once: the candidate's process hears nothing more, and is killed
        report(job["result_fd"], {"ok": False, "error": str(error)[:500]})

    link = Link(Channel(job["channel"][0], job["channel"][1]), fail)
    manifest = link.receive()
    if "error" in manifest:
        fail(str(manifest["error"]))
    sent = manifest.get("names") if type(manifest.get("names")) is dict else {}
    # the task's names only, whatever the manifest holds: builtins and modules stay the tests' own
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for name in job["modules"]:  # modules the tests use without importing them
        try:
            namespace[name] = importlib.import_module(name)
        except Exception:  # noqa: BLE001
            pass
    program = {}
    for name in job["names"]:
        if name in sent:
            program[name] = link.value(sent[name])
        elif name in job["required"]:  # else a builtin of that name would stand in for it
            fail(f"the program does not define {name}")
    namespace.update(program)
    module = types.ModuleType("solution")
    module.__dict__.update(program)
    sys.modules["solution"] = module  # so tests may `from solution import f`
    if "unittest" in job["tests"]:
        # the real unittest.main() would look for test cases in this start-up code's `__main__`: the
        # tests' script ends there as with its exit, and their test cases run next, collected
        import unittest
        unittest.main = lambda *args, **kwargs: sys.exit(0)

    def collected():  # what the tests defined (or redefined), not the candidate's names
        names = [n for n, v in list(namespace.items()) if not n.startswith("__") and v is not program.get(n)]
        _run_collected(namespace, names, fail)

    for step in (lambda: exec(tests, namespace), collected):
        try:
            step()
        except SystemExit as exc:  # the tests' own exit (never the candidate's: it is not relayed)
            if exc.code not in (None, 0):
                fail(describe(exc))
        except BaseException as exc:  # noqa: BLE001
            fail(describe(exc))
    return {"ok": True, "error": None}


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
    result_fd = job["result_fd"]
    source, filename = (job["tests"], "/sandbox/tests.py") if job["role"] == "tests" else (job["program"], "/sandbox/solution.py")
    with open(filename, "w", encoding="utf-8") as f:  # tracebacks and `inspect.getsource` find the source
        f.write(source)
    try:
        code = compile(source, filename, "exec")
    except BaseException as exc:  # noqa: BLE001  (a syntax error fails the run; it is not a crash)
        if job["role"] == "serve":
            Channel(*job["channel"]).send({"error": describe(exc)})
            os._exit(0)
        report(result_fd, {"ok": False, "phase": "compile", "error": describe(exc)})
    if job["role"] == "stdio":
        report(result_fd, run_stdio(job, code))
    elif job["role"] == "serve":
        serve(job, code)
        os._exit(0)
    else:
        report(result_fd, run_tests(job, code))


main()
