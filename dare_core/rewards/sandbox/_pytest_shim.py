"""A small `pytest` for the tests' jail (importable there as `pytest`; loaded by `_sandbox_child.py`).

The jail holds the standard library only, and the trainer's environment need not have pytest at all
(it is a development dependency), so tests that `import pytest` get this instead of the real one:
`raises` (context and call forms, `match`), `approx` (numbers, sequences, dicts; pytest's default
tolerances), `mark.parametrize` (stacked, `param`), `mark.skip`/`skipif`/`xfail`, `fixture` (by name,
`yield` fixtures, `autouse`, `usefixtures`; every fixture is function-scoped, without `params`), `skip`, `fail`, `importorskip` and
`main` (ends the tests' script like `unittest.main()`; their tests then run). `run_test` runs one
collected test function with these. Builtin fixtures (`capsys`, `tmp_path`, `monkeypatch`) are not
here: the program runs in another process, whose output and files these tests cannot see.
"""
import itertools
import math
import re
import types


class Skipped(BaseException):
    """A skip (like pytest's: not an Exception, so no `except Exception` of the tests swallows it)."""


class Failed(AssertionError):
    """`pytest.fail()`: the tests' own failure, recorded like a failed assert."""


def skip(reason="", allow_module_level=False):
    raise Skipped(reason)


def fail(reason="", pytrace=True):
    raise Failed(reason)


def xfail(reason=""):
    raise Skipped(reason)


skip.Exception, fail.Exception = Skipped, Failed


def importorskip(name, minversion=None, reason=None):
    try:
        return __import__(name)
    except ImportError:
        raise Skipped(reason or f"could not import {name!r}") from None


def main(*args, **kwargs):
    raise SystemExit(0)


# ---- raises -----------------------------------------------------------------------------------------

class ExceptionInfo:
    def __init__(self):
        self.value = self.type = self.tb = None

    @property
    def typename(self):
        return self.type.__name__ if self.type else None

    def match(self, pattern):
        assert re.search(pattern, str(self.value)), f"pattern {pattern!r} does not match {str(self.value)!r}"
        return True

    def errisinstance(self, kind):
        return isinstance(self.value, kind)


class RaisesContext:
    def __init__(self, expected, match):
        self.expected, self.pattern, self.info = expected, match, ExceptionInfo()

    def __enter__(self):
        return self.info

    def __exit__(self, kind, value, traceback):
        if kind is None:
            raise Failed(f"DID NOT RAISE {self.expected}")
        if not issubclass(kind, self.expected):
            return False
        self.info.value, self.info.type, self.info.tb = value, kind, traceback
        if self.pattern is not None:
            self.info.match(self.pattern)
        return True


def raises(expected, *args, match=None, **kwargs):
    if not args:
        return RaisesContext(expected, match)
    with RaisesContext(expected, match) as info:
        args[0](*args[1:], **kwargs)
    return info


# ---- approx -----------------------------------------------------------------------------------------

def _close(expected, actual, rel, absolute, nan_ok):
    if isinstance(expected, dict):
        return (isinstance(actual, dict) and set(actual) == set(expected)
                and all(_close(expected[k], actual[k], rel, absolute, nan_ok) for k in expected))
    if isinstance(expected, (list, tuple)):
        return (isinstance(actual, (list, tuple)) and len(actual) == len(expected)
                and all(_close(e, a, rel, absolute, nan_ok) for e, a in zip(expected, actual)))
    numbers = (int, float, complex)
    if type(expected) is bool or type(actual) is bool or not (isinstance(expected, numbers) and isinstance(actual, numbers)):
        return expected == actual
    if expected != expected or actual != actual:  # NaN
        return nan_ok and expected != expected and actual != actual
    if expected in (math.inf, -math.inf):
        return actual == expected
    return abs(expected - actual) <= max(rel * abs(expected), absolute)


class ApproxValue:
    def __init__(self, expected, rel, absolute, nan_ok):
        if rel is None:  # pytest: a given `abs` alone drops the relative tolerance
            rel = 0.0 if absolute is not None else 1e-6
        self.expected, self.rel, self.abs, self.nan_ok = expected, rel, 1e-12 if absolute is None else absolute, nan_ok

    def __eq__(self, actual):
        return _close(self.expected, actual, self.rel, self.abs, self.nan_ok)

    def __ne__(self, actual):
        return not self.__eq__(actual)

    __hash__ = None

    def __repr__(self):
        return f"approx({self.expected!r})"


def approx(expected, rel=None, abs=None, nan_ok=False):  # noqa: A002  (pytest's own argument name)
    return ApproxValue(expected, rel, abs, nan_ok)


# ---- marks, parameters, fixtures ----------------------------------------------------------------------

class MarkDecorator:
    def __init__(self, name, args=(), kwargs=None):
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (type, types.FunctionType)):
            target = args[0]
            target.pytestmark = [*target.__dict__.get("pytestmark", []), self]
            return target
        return MarkDecorator(self.name, self.args + args, {**self.kwargs, **kwargs})


class _Marks:
    def __getattr__(self, name):
        return MarkDecorator(name)


mark = _Marks()


class ParameterSet:
    def __init__(self, values, marks):
        self.values, self.marks = values, list(marks) if isinstance(marks, (list, tuple)) else [marks]


def param(*values, marks=(), id=None):  # noqa: A002
    return ParameterSet(values, marks)


def fixture(function=None, *, scope="function", params=None, autouse=False, name=None, ids=None):
    def register(fn):
        fn._pytest_fixture = {"name": name or fn.__name__, "autouse": autouse}
        return fn
    return register(function) if function is not None else register


def _cases(marks):
    """(arguments, marks) of each call that the `parametrize` marks ask for (their product)."""
    axes = []
    for found in marks:
        if found.name != "parametrize":
            continue
        names, values = found.args[0], found.args[1]
        names = [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)
        axis = []
        for value in values:
            extra = value.marks if isinstance(value, ParameterSet) else []
            value = value.values if isinstance(value, ParameterSet) else (value,) if len(names) == 1 else value
            axis.append((dict(zip(names, value)), extra))
        axes.append(axis)
    for combination in itertools.product(*axes):
        yield {k: v for given, _ in combination for k, v in given.items()}, [m for _, extra in combination for m in extra]


def _skipped(marks, namespace):
    for found in marks:
        if found.name == "skip":
            return True
        if found.name == "skipif":
            condition = found.args[0] if found.args else found.kwargs.get("condition", False)
            if eval(condition, namespace) if isinstance(condition, str) else condition:
                return True
    return False


def _call(function, given, fixtures, cache, finalizers, bound=()):
    code = function.__code__
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount][len(bound):]
    defaulted = set(code.co_varnames[code.co_argcount - len(function.__defaults__ or ()):code.co_argcount])
    defaulted |= set(function.__kwdefaults__ or ())
    arguments = {}
    for name in names:
        if name in given:
            arguments[name] = given[name]
        elif name not in defaulted:
            arguments[name] = _fixture(name, given, fixtures, cache, finalizers)
    return function(*bound, **arguments)


def _fixture(name, given, fixtures, cache, finalizers):
    if name not in cache:
        if name not in fixtures:
            raise LookupError(f"fixture {name!r} not found (the sandbox's pytest has no builtin fixtures)")
        value = _call(fixtures[name], given, fixtures, cache, finalizers)
        if isinstance(value, types.GeneratorType):  # a `yield` fixture: the rest runs after the test
            finalizers.append(value)
            value = next(value)
        cache[name] = value
    return cache[name]


def run_test(function, namespace, failures, owner=None):
    """Run a collected test (a function, or method `function` of class `owner`) once per parameter
    set, with its fixtures; what leaves it is a recorded failure, unless it is a skip or expected.
    Returns how many of its calls ran to the end without being skipped."""
    marks = [*(owner.__dict__.get("pytestmark", []) if owner else []), *getattr(function, "pytestmark", [])]
    fixtures = {v._pytest_fixture["name"]: v for v in list(namespace.values()) if hasattr(v, "_pytest_fixture")}
    used = [v._pytest_fixture["name"] for v in fixtures.values() if v._pytest_fixture["autouse"]]
    used += [name for m in marks if m.name == "usefixtures" for name in m.args]
    ran = 0
    if _skipped(marks, namespace):
        return ran
    for given, extra in _cases(marks):
        if _skipped(extra, namespace):
            continue
        start, cache, finalizers = failures.mark(), {}, []
        try:
            bound = (owner(),) if owner else ()
            if bound and hasattr(bound[0], "setup_method"):
                bound[0].setup_method(function)
            for name in used:
                _fixture(name, given, fixtures, cache, finalizers)
            _call(function, given, fixtures, cache, finalizers, bound)
            if bound and hasattr(bound[0], "teardown_method"):
                bound[0].teardown_method(function)
            ran += 1
        except Skipped:
            pass
        except SystemExit as exc:
            if exc.code not in (None, 0):
                failures.record(exc)
        except Exception as exc:  # noqa: BLE001
            failures.record(exc)
        for finalizer in reversed(finalizers):
            try:
                next(finalizer, None)
            except Exception as exc:  # noqa: BLE001
                failures.record(exc)
        if any(m.name == "xfail" for m in [*marks, *extra]):
            failures.drop(start)
    return ran


def __getattr__(name):
    raise AttributeError(f"the sandbox's pytest has no {name!r} (raises, approx, mark, fixture, param, skip, fail)")
