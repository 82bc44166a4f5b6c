"""Trusted start-up code of a sandboxed child: `python -s -S -B -c <this file's text>`.

Read by `dare_core.rewards.sandbox` and run as the first code of the child, before any untrusted
code. It reads the job (JSON) from stdin, points stdin at /dev/null, lowers the resource limits,
installs an audit hook (which cannot be removed) and only then compiles and runs the program and its
tests. The verdict goes to a dedicated pipe as one line, `<nonce><repr of a dict>`; output on fds 1/2
is the program's own. Self-contained: no `dare_core` import.

The hook refuses, with PermissionError (and any such refusal, even one the program catches, fails
the run); a refused import raises ImportError instead, as if the module were not installed:
- network: sockets of any family but AF_UNIX (socket pairs, as asyncio's self-pipe), AF_UNIX
  addresses outside the working directory and abstract ones, name lookups, and importing `_ssl`;
- processes: `os.fork`, `os.forkpty`, `os.exec`, `os.posix_spawn`, `os.spawn`, `os.system`,
  `subprocess.Popen`, `pty.spawn`, signals to other processes, and importing the real
  `_posixsubprocess` (a refusing stub stands in, so `import subprocess` works), `_multiprocessing`,
  `_posixshmem`, sub-interpreters;
- native code: `ctypes.*`, importing `ctypes`/`_ctypes`, the C-API test modules, and any extension
  module from outside the Python installation (the `import` event names its file);
- files: `open` (builtin, `io`, `os.open`) outside the private working directory, except read-only
  opens of regular files under the Python installation and /dev/null, /dev/urandom; special files
  (devices, FIFOs) even inside; the path/metadata events (`os.remove`, `os.rename`, `os.mkdir`,
  `os.chmod`, `os.listdir`, `shutil.*`, ...) by the same rule; links, `..` components, and path
  objects other than str, bytes and fd in C-level events (which receive paths already converted by
  `os.fspath`, so pathlib works);
- `resource.setrlimit`/`prlimit`, `mmap`, `fcntl.ioctl`, `gc.get_objects` and friends.
`os.mkfifo`/`os.mknod` (which raise no audit event) are removed from `os` before the program runs.
"""
import builtins
import io
import json
import os
import resource
import stat
import sys

_REFUSED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
    "os.startfile", "os.link", "os.symlink", "subprocess.Popen", "pty.spawn", "signal.pthread_kill",
    "resource.setrlimit", "resource.prlimit", "mmap.__new__", "fcntl.ioctl",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.remote_exec", "sqlite3.load_extension",
    "sqlite3.enable_load_extension", "webbrowser.open",
})
_REFUSED_PREFIXES = ("ctypes.", "syslog.", "winreg.", "_winapi.")
# Name service lookups (DNS, /etc/services via libc); socket creation and addresses are checked apart.
_REFUSED_SOCKET_EVENTS = frozenset({
    "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
    "socket.getservbyname", "socket.getservbyport", "socket.sethostname",
})
_SOCKET_ADDRESS_EVENTS = frozenset({"socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg"})
_AF_UNIX = 1
_REFUSED_MODULES = frozenset({
    "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "_ssl", "_multiprocessing",
    "_posixshmem", "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_interpchannels",
    "_interpqueues", "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase",
    "_testimportmultiple", "_testclinic", "_testsinglephase", "_xxtestfuzz", "_sqlite3", "_dbm", "_gdbm",
    "pwd", "grp", "spwd", "nis", "syslog", "readline", "_curses", "_curses_panel", "_tkinter",
    "ossaudiodev", "termios",
})
# event -> ((argument index, "read" | "write"), ...); "write" paths must lie in the working directory.
_PATH_EVENTS = {
    "os.listdir": ((0, "read"),), "os.scandir": ((0, "read"),), "os.walk": ((0, "read"),),
    "os.fwalk": ((0, "read"),), "os.getxattr": ((0, "read"),), "os.listxattr": ((0, "read"),),
    "os.chdir": ((0, "write"),), "os.chmod": ((0, "write"),), "os.chown": ((0, "write"),),
    "os.chflags": ((0, "write"),), "os.lchflags": ((0, "write"),), "os.lchmod": ((0, "write"),),
    "os.mkdir": ((0, "write"),), "os.remove": ((0, "write"),), "os.rmdir": ((0, "write"),),
    "os.rename": ((0, "write"), (1, "write")), "os.truncate": ((0, "write"),), "os.utime": ((0, "write"),),
    "os.setxattr": ((0, "write"),), "os.removexattr": ((0, "write"),),
    "shutil.rmtree": ((0, "write"),), "shutil.copyfile": ((0, "read"), (1, "write")),
    "shutil.copymode": ((0, "read"), (1, "write")), "shutil.copystat": ((0, "read"), (1, "write")),
    "shutil.copytree": ((0, "read"), (1, "write")), "shutil.move": ((0, "write"), (1, "write")),
    "shutil.chown": ((0, "write"),), "shutil.make_archive": ((0, "write"), (2, "read")),
    "shutil.unpack_archive": ((0, "read"), (1, "write")), "sqlite3.connect": ((0, "write"),),
    "tempfile.mkstemp": ((0, "write"),), "tempfile.mkdtemp": ((0, "write"),),
}
# Events raised from Python code (before the C calls, which raise their own events).
_PYTHON_LEVEL_PREFIXES = ("os.walk", "os.fwalk", "shutil.", "tempfile.")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_DEVICES_RW = frozenset({"/dev/null"})
_DEVICES_R = frozenset({"/dev/urandom", "/dev/random", "/dev/zero"})


def _install_guard(work, roots, max_created, refusals):
    """Add the audit hook. Everything it uses is bound here, in closures over immutable values."""
    realpath, lstat, fsdecode, sep = os.path.realpath, os.lstat, os.fsdecode, os.sep
    S_ISREG, S_ISDIR = stat.S_ISREG, stat.S_ISDIR
    refused_events, refused_prefixes, refused_modules = _REFUSED_EVENTS, _REFUSED_PREFIXES, _REFUSED_MODULES
    path_events, write_flags, devices_rw, devices_r = _PATH_EVENTS, _WRITE_FLAGS, _DEVICES_RW, _DEVICES_R
    python_level = _PYTHON_LEVEL_PREFIXES
    socket_refused, socket_addressed, af_unix = _REFUSED_SOCKET_EVENTS, _SOCKET_ADDRESS_EVENTS, _AF_UNIX
    roots = tuple(roots)
    created = [0]
    note = refusals.append

    def refuse(why):
        if len(refusals) < 20:
            note(why)
        raise PermissionError("sandbox: " + why)

    def inside(path, base):
        return path == base or path.startswith(base + sep)

    def resolve(path, event):
        """Absolute, symlink-free form of a path argument; None for a file descriptor."""
        kind = type(path)
        if kind is int or path is None:
            return None
        if kind is str:
            text = path
        elif kind is bytes:
            text = fsdecode(path)
        elif event.startswith(python_level):
            # raised by Python code with the caller's object (e.g. a pathlib path); the os calls
            # that do the work raise their own events, with the converted path, and are checked
            return None
        else:
            # C-level events get the path already converted by os.fspath; anything else is refused
            # rather than converted a second time (a PathLike could answer differently)
            refuse(f"{event}: path of type {kind.__name__}")
        if ".." in text.split("/"):
            refuse(f"{event}: '..' in {text!r}")
        return realpath(text)

    def readable(path):
        return path in devices_rw or path in devices_r or any(inside(path, root) for root in roots)

    def check_path(path, mode, event):
        resolved = resolve(path, event)
        if resolved is None or inside(resolved, work):
            return
        if mode == "read" and readable(resolved):
            return
        refuse(f"{event} {path!r} outside the working directory")

    def check_open(path, mode, flags):
        resolved = resolve(path, "open")
        if resolved is None:
            return
        writing = (type(mode) is str and any(c in mode for c in "wax+")) or (
            type(flags) is int and flags & write_flags)
        if inside(resolved, work):
            try:
                info = lstat(resolved)
            except OSError:
                info = None
            if info is not None and not (S_ISREG(info.st_mode) or S_ISDIR(info.st_mode)):
                refuse(f"open {path!r}: not a regular file")
            if writing and info is None:
                created[0] += 1
                if created[0] > max_created:
                    refuse(f"open {path!r}: more than {max_created} files created")
            return
        if resolved in devices_rw:
            return
        if not writing and (resolved in devices_r or any(inside(resolved, root) for root in roots)):
            try:
                info = lstat(resolved)
            except OSError:
                return
            if S_ISREG(info.st_mode):
                return
        refuse(f"open {path!r} ({'write' if writing else 'read'}) outside the working directory")

    def hook(event, args):
        if event == "open":
            check_open(*args[:3])
            return
        if event in refused_events or event.startswith(refused_prefixes):
            refuse(event)
        if event == "import":
            name = args[0]
            if type(name) is str and any(part in refused_modules for part in name.split(".")):
                # as if the module were not installed: `try: import ssl except ImportError` still works,
                # and this alone does not fail the run
                raise ImportError(f"sandbox: import {name} refused", name=name)
            if len(args) > 1 and args[1] is not None:
                origin = resolve(args[1], "import")
                if origin is not None and not any(inside(origin, root) for root in roots):
                    refuse(f"import {name} from {args[1]!r}: native code outside the Python installation")
            return
        if event.startswith("socket."):
            if event in socket_refused:
                refuse(event)
            if event == "socket.__new__" and (len(args) < 2 or args[1] != af_unix):
                refuse(f"socket of family {args[1] if len(args) > 1 else '?'} (only AF_UNIX socket pairs)")
            if event in socket_addressed and len(args) > 1 and args[1] is not None:
                address = args[1]
                if type(address) not in (str, bytes) or address[:1] in ("\0", b"\0"):
                    refuse(f"{event} to {address!r}")
                check_path(address, "write", event)
            return
        spec = path_events.get(event)
        if spec is not None:
            for index, mode in spec:
                if index < len(args):
                    check_path(args[index], mode, event)

    # `subprocess` (imported by asyncio, platform, ...) needs `_posixsubprocess` at import time, but its
    # fork_exec raises no audit event: the real module is never loaded (a fresh import of it is refused
    # above) and a stub that refuses stands in for it.
    def fork_exec(*args, **kwargs):
        refuse("_posixsubprocess.fork_exec")

    stub = type(sys)("_posixsubprocess")
    stub.fork_exec = fork_exec
    sys.modules["_posixsubprocess"] = stub
    sys.addaudithook(hook)


def _set_limits(limits):
    failed = []

    def cap(name, soft, hard=None):
        which = getattr(resource, name, None)
        if which is None:
            failed.append(name)
            return
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            failed.append(name)

    cap("RLIMIT_CORE", 0)
    cap("RLIMIT_CPU", limits["cpu_s"], limits["cpu_s"] + 1)
    cap("RLIMIT_AS", limits["memory_bytes"])
    cap("RLIMIT_FSIZE", limits["file_bytes"])
    cap("RLIMIT_NOFILE", limits["open_files"])
    cap("RLIMIT_MEMLOCK", 0)
    cap("RLIMIT_MSGQUEUE", 0)
    if limits.get("processes") is not None:
        cap("RLIMIT_NPROC", limits["processes"])
    return failed


class _CappedBuffer(io.BytesIO):
    """Keeps the first `cap` bytes written; notes whether more came."""

    def __init__(self, cap):
        super().__init__()
        self.cap, self.overflow = cap, False

    def write(self, data):
        data = bytes(data)
        room = self.cap - self.tell()
        if room > 0:
            super().write(data[:room])
        if len(data) > room:
            self.overflow = True
        return len(data)


def _describe(exc):
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001  (a user exception's __str__ may itself fail)
        text = "?"
    return (type(exc).__name__ + (": " + text if text else ""))[:500]


def _feed_stdin(data):
    """Point fd 0 (and sys.stdin) at a pipe holding `data`: `input()`, `sys.stdin.buffer` and `open(0)`
    all read the case input."""
    read_end, write_end = os.pipe()
    if read_end != 0:  # 0 itself when the previous case closed it (e.g. via `open(0)`)
        os.dup2(read_end, 0)
        os.close(read_end)
    if len(data) < 60000:  # fits the pipe buffer: write it all now
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


def _run_collected(namespace, names, function_type):
    """Run what test code defines in pytest or unittest style: `test*` functions, `Test*` classes
    (methods `test*`), and `unittest.TestCase` subclasses. Raises on the first failure."""
    unittest = sys.modules.get("unittest")
    for name in names:
        obj = namespace[name]
        if name.startswith("test") and type(obj) is function_type:
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


def _main():
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    nonce, result_fd = job["nonce"], job["result_fd"]
    write, exit_now, as_text, view_of = os.write, os._exit, repr, memoryview

    def finish(payload):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        try:
            view = view_of((nonce + as_text(payload) + "\n").encode("utf-8", "backslashreplace"))
            while view:
                view = view[write(result_fd, view):]
        finally:
            exit_now(0)

    refusals = []
    failed_limits = _set_limits(job["limits"])

    # `exit()`/`quit()` come from the `site` module, which -S skips; programs use them.
    def leave(code=None):
        raise SystemExit(code)

    builtins.exit = builtins.quit = leave
    for name in ("mkfifo", "mknod"):  # create special files at any path, with no audit event
        for module in (os, sys.modules.get("posix")):
            if module is not None and hasattr(module, name):
                delattr(module, name)
    try:
        program = compile(job["program"], "solution.py", "exec")
        tests = compile(job["tests"], "tests.py", "exec") if job.get("tests") else None
    except BaseException as exc:  # noqa: BLE001  (a syntax error is a failed run, not a crash)
        finish({"ok": False, "phase": "compile", "error": _describe(exc), "refusals": [],
                "failed_limits": failed_limits})
    _install_guard(job["workdir"], job["read_roots"], job["max_created_files"], refusals)
    phase = "program"
    try:
        if job.get("inputs") is not None:
            cases = []
            real_stdin, real_stdout = sys.stdin, sys.stdout
            for text in job["inputs"]:
                captured = _CappedBuffer(job["case_output_bytes"])
                sys.stdin = _feed_stdin(text.encode("utf-8"))
                sys.stdout = io.TextIOWrapper(captured, encoding="utf-8", write_through=True)
                ok, error = True, None
                try:
                    exec(program, {"__name__": "__main__", "__builtins__": builtins})
                except SystemExit as exc:
                    if exc.code not in (None, 0):
                        ok, error = False, _describe(exc)
                except BaseException as exc:  # noqa: BLE001
                    ok, error = False, _describe(exc)
                try:
                    sys.stdout.flush()
                except BaseException:  # noqa: BLE001
                    pass
                # read before the wrapper goes away: collecting it closes the buffer
                output = captured.getvalue() if not captured.closed else b""
                sys.stdin, sys.stdout = real_stdin, real_stdout
                cases.append({"ok": ok, "error": error, "truncated": captured.overflow,
                              "stdout": output.decode("utf-8", "replace")})
            finish({"ok": not refusals, "cases": cases, "refusals": list(refusals),
                    "failed_limits": failed_limits})
        module = type(sys)("solution")
        namespace = module.__dict__
        namespace["__builtins__"] = builtins
        sys.modules["solution"] = module  # so tests may `from solution import f`
        exec(program, namespace)
        if tests is not None:
            phase = "tests"
            before = set(namespace)
            exec(tests, namespace)
            _run_collected(namespace, [name for name in namespace if name not in before], type(leave))
        finish({"ok": not refusals, "refusals": list(refusals), "failed_limits": failed_limits})
    except BaseException as exc:  # noqa: BLE001
        finish({"ok": False, "phase": phase, "error": _describe(exc), "refusals": list(refusals),
                "failed_limits": failed_limits})


_main()
