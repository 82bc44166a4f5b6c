"""Trusted start-up code of a jailed process: `python -I -S -B -c <this file's text> <uid> <gid>`.

It runs inside the bubblewrap jail that `dare_core.rewards.sandbox` builds, before any untrusted
code: it leaves root for the given unprivileged uid (when the jail was started by root), lowers the
resource limits, reads its job (JSON) from stdin and plays one of three roles. Self-contained: the
jail holds only the standard library, no `dare_core`.

- `stdio`: run the program once per input as `__main__`, with the input on stdin and fd 1 captured
  into a file of the private work dir; report each case's raw output. The parent compares outputs.
- `serve`: the candidate's side of a test run. Execute the program as module `solution`, send the
  names it defines, then answer requests (call this, get that attribute) with JSON-encoded values.
  Everything here is under the candidate's control, so nothing it sends is trusted: it is data.
- `tests`: the tests' side, in a jail of its own that never runs candidate code. The tests execute
  here against proxies of the candidate's names; a call crosses to the `serve` process and comes
  back as plain values (int, str, list, tuple, dict, ...), and objects that are not plain values
  come back as opaque handles that compare equal only to themselves. The verdict is this
  process's, so no object, frame or function of the candidate can decide it.

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
# exceptions a candidate may raise in `tests` under their own class; the rest arrive as RemoteError
_NOT_RELAYED = (SystemExit, KeyboardInterrupt, GeneratorExit)


class RemoteError(Exception):
    """An exception of the candidate's process that has no builtin class of the same name here."""


class ProtocolError(BaseException):
    """The candidate's process sent something that is not a well-formed reply, or went away. Not an
    Exception, so that tests written as `try: f(x) except Exception: pass` cannot swallow it."""


def leave_root(uid, gid):
    """Drop to the unprivileged uid/gid (only when the jail started us as root: bubblewrap run by root
    without a user namespace); all capabilities go with uid 0."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    if 0 in os.getresuid() or 0 in os.getresgid():
        raise SystemExit("sandbox: still root after dropping privileges")


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
    for name, value in list(module.__dict__.items()):
        if type(name) is str and not name.startswith("__"):
            try:
                names[name] = {"$": "module", "name": value.__name__} if type(value) is types.ModuleType else encode(value, handle)
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
    """The tests' end of the channel to the candidate's process."""

    def __init__(self, channel):
        self.channel = channel

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
        message = self.channel.receive()
        if message is None:
            raise ProtocolError("the program under test exited")
        if type(message) is not dict:
            raise ProtocolError("malformed reply")
        return message

    def request(self, message):
        self.channel.send(message)
        reply = self.receive()
        if "raise" in reply:
            raise _relayed(reply["raise"])
        if "value" not in reply:
            raise ProtocolError("malformed reply")
        return decode(reply["value"], self.reference)


def _relayed(info):
    name = info.get("type") if type(info) is dict else None
    message = str(info.get("message", ""))[:500] if type(info) is dict else ""
    cls = getattr(builtins, name, None) if type(name) is str else None
    if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, _NOT_RELAYED):
        try:
            return cls(message.split(": ", 1)[-1])
        except BaseException:  # noqa: BLE001  (exceptions whose constructor needs other arguments)
            pass
    return RemoteError(message)


def _run_collected(namespace, names):
    """Run what test code defines in pytest or unittest style: `test*` functions, `Test*` classes
    (methods `test*`), and `unittest.TestCase` subclasses. Raises on the first failure."""
    unittest = sys.modules.get("unittest")
    for name in names:
        obj = namespace[name]
        if name.startswith("test") and type(obj) is types.FunctionType:
            obj()
        elif isinstance(obj, type) and unittest is not None and issubclass(obj, unittest.TestCase):
            suite = unittest.defaultTestLoader.loadTestsFromTestCase(obj)
            outcome = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
            if not outcome.wasSuccessful() or outcome.testsRun == 0:
                problems = outcome.failures + outcome.errors
                detail = problems[0][1].strip().splitlines()[-1] if problems else "no tests ran"
                raise AssertionError(f"{name}: {detail}")
        elif isinstance(obj, type) and name.startswith("Test"):
            instance = obj()
            for attribute in sorted(dir(obj)):
                if attribute.startswith("test") and callable(getattr(instance, attribute)):
                    getattr(instance, attribute)()


def run_tests(job, tests):
    import importlib

    link = Link(Channel(job["channel"][0], job["channel"][1]))
    try:
        manifest = link.receive()
    except ProtocolError as exc:
        return {"ok": False, "phase": "program", "error": describe(exc)}
    if "error" in manifest:
        return {"ok": False, "phase": "program", "error": str(manifest["error"])[:500]}
    names = {}
    entries = manifest.get("names")
    for name, value in (entries.items() if type(entries) is dict else ()):
        # builtins are never the candidate's: `abs` or `len` in a test means the real ones
        if not name.isidentifier() or name in builtins.__dict__:
            continue
        if type(value) is dict and value.get("$") == "module":
            try:  # our own copy of a module the program imported (tests may lean on its imports)
                names[name] = importlib.import_module(str(value.get("name")))
            except BaseException:  # noqa: BLE001
                pass
            continue
        try:
            names[name] = decode(value, link.reference)
        except ProtocolError as exc:
            return {"ok": False, "phase": "program", "error": describe(exc)}
    module = types.ModuleType("solution")
    module.__dict__.update(names)
    sys.modules["solution"] = module  # so tests may `from solution import f`
    namespace = {"__name__": "__main__", "__builtins__": builtins, **names}
    try:
        exec(tests, namespace)
        # what the tests defined (or redefined), not the candidate's names
        defined = [n for n, v in list(namespace.items()) if not n.startswith("__") and (n not in names or v is not names[n])]
        _run_collected(namespace, defined)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return {"ok": False, "phase": "tests", "error": describe(exc)}
    except BaseException as exc:  # noqa: BLE001
        return {"ok": False, "phase": "tests", "error": describe(exc)}
    return {"ok": True}


def main():
    leave_root(int(sys.argv[1]), int(sys.argv[2]))
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
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
