"""The program's values as the tests see them (role `tests`, in the tests' jail, which never runs
candidate code; loaded by `_sandbox_child.py`). The candidate's side is `_harness_serve.py`.

What comes from the program is data, and only types of this jail decide comparisons:
- plain values (exact int, float, str, bool, None, bytes, complex, list, dict, set, frozenset) arrive
  as themselves; a tuple arrives as `CandidateTuple`, a tuple that also equals a list of the same
  items (where the tests expect a list, the right items in a tuple are not a wrong answer);
- any other object arrives as a `Remote`: it can be called, its attributes read and it can be
  iterated (each crosses to the program's jail and comes back the same way). It has no truth value.
  Two Remotes are equal when they are the same object, or two instances of the same class of the
  program's with equal attributes (compared here by these same rules): never by the program's own
  `__eq__`, which could say anything. Against anything else a Remote defers to the other side, so a
  class the problem defines compares with the problem's `__eq__`, reading the program's object's attributes;
- an iterator (a generator, `map`, ...) arrives as a `RemoteIterator`, which the tests can iterate
  lazily and which equals a list with the items it yields (drained, up to DRAIN_MAX items);
- a float NaN anywhere in a value is a failure of the run unless the tests name NaN themselves (a
  NaN passes every check written as "fail if the difference is above eps");
- a call that returns None sends back its arguments' new contents, copied into the tests' own
  objects: tests check a list sorted in place. A call that returns a value leaves the tests'
  objects as they were, so no answer can also rewrite the data it is compared with.
"""
import builtins
import collections
import math

from __main__ import _CONTAINERS, MAX_DEPTH, ProtocolError, decode, describe, encode

DRAIN_MAX = 100_000  # items of an iterator compared with a list; a longer one is not equal
# builtin exceptions that steer control flow rather than report an error, never raised in the tests
# under their own class: a StopIteration ends the tests' map() or next(), an AssertionError passes
# for the tests' own failure, ImportError picks import fallbacks, Warning feeds warning filters.
# BaseExceptions that are not Exceptions (SystemExit, GeneratorExit, ...) are never relayed either.
_NOT_RELAYED = (AssertionError, StopIteration, StopAsyncIteration, ImportError, Warning)
_RELAYED_CLASSES = {}


class CandidateError(Exception):
    """An exception of the candidate's process. One of a builtin error class outside _NOT_RELAYED
    arrives as a subclass of both, so that tests expecting it (`except ValueError`) still catch it;
    any other arrives as CandidateError itself, which only `except Exception` catches."""


def relayed(info):
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


class Failures:
    """The checks that failed, recorded as they fail; the verdict is read once every test has run.
    Recording is one append: a failed check costs the tests' side no noticeable time."""

    def __init__(self):
        self.items = []

    def record(self, failure):
        self.items.append(failure)

    def mark(self):
        return len(self.items)

    def drop(self, mark):  # an expected failure (xfail, unittest.expectedFailure) does not count
        del self.items[mark:]

    def verdict(self):
        if not self.items:
            return {"ok": True, "error": None}
        first = self.items[0]
        text = first if type(first) is str else describe(first)
        return {"ok": False, "error": f"{len(self.items)} failed check(s), the first: {text}"}


class CandidateTuple(tuple):
    """A tuple of the program's: equal to what a tuple is equal to, and to a list of the same items."""

    __slots__ = ()

    def __eq__(self, other):
        if type(other) is list:
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = tuple.__hash__


class Remote:
    """A name or object of the candidate's process (see the module docstring)."""

    __slots__ = ("_id", "_type", "_link")

    def __init__(self, link, index, type_name):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_id", index)
        object.__setattr__(self, "_type", type_name)

    def __call__(self, *args, **kwargs):
        return self._link.call(self._id, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.request({"op": "getattr", "target": self._id, "name": name})

    def __iter__(self):
        value = self._link.request({"op": "iter", "target": self._id})
        if isinstance(value, RemoteIterator):
            return value
        if isinstance(value, Remote):
            raise TypeError(f"iter() of a {self._type} object of the program under test is not an iterator")
        return iter(value)

    def __eq__(self, other):
        if not isinstance(other, Remote) or other._link is not self._link:
            return NotImplemented
        return other._id == self._id or self._link.same_state(self, other)

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self):  # equal objects are of one class: a hash of its name is consistent with __eq__
        return hash(self._type)

    def __repr__(self):
        return f"<remote {self._type} object>"

    def __bool__(self):
        # its own __bool__ would decide `assert f(x)`: only plain values have a truth value here
        raise TypeError(f"the truth value of a {self._type} object of the program under test is not checked "
                        "(return a plain value)")


class RemoteIterator(Remote):
    """An iterator of the program's: iterated lazily (items fetched in growing batches), and equal
    to a list of the items it yields, which a comparison drains into a buffer without consuming."""

    __slots__ = ("_items", "_done", "_batch")

    def __init__(self, link, index, type_name):
        super().__init__(link, index, type_name)
        object.__setattr__(self, "_items", collections.deque())
        object.__setattr__(self, "_done", False)
        object.__setattr__(self, "_batch", 1)

    def __iter__(self):
        return self

    def __next__(self):
        if not self._items and not self._done:
            self._fetch()
        if not self._items:
            raise StopIteration
        return self._items.popleft()

    def _fetch(self):
        items, done = self._link.next(self._id, self._batch)
        object.__setattr__(self, "_batch", min(self._batch * 2, 4096))
        object.__setattr__(self, "_done", done or not items)
        self._items.extend(items)

    def __eq__(self, other):
        if type(other) is list:
            while not self._done and len(self._items) <= DRAIN_MAX:
                self._fetch()
            return self._done and list(self._items) == other
        return Remote.__eq__(self, other)

    __hash__ = Remote.__hash__


def _has_nan(value, depth=0):
    kind = type(value)
    if kind is float:
        return math.isnan(value)
    if kind is complex:
        return math.isnan(value.real) or math.isnan(value.imag)
    if depth > MAX_DEPTH + 2:
        return False
    if kind is dict:
        return any(_has_nan(k, depth + 1) or _has_nan(v, depth + 1) for k, v in value.items())
    if kind in (list, CandidateTuple, set, frozenset):
        return any(_has_nan(item, depth + 1) for item in value)
    return False


def _sync(old, new, depth=0):
    """Give the tests' container `old` the contents of `new` (what the program made of it), keeping
    the tests' own nested containers where both sides have one of the same type."""
    def merged(a, b):
        if type(a) is type(b) and type(a) in (list, dict, set) and depth < MAX_DEPTH:
            _sync(a, b, depth + 1)
            return a
        return b

    if type(old) is list and type(new) is list:
        old[:] = [merged(a, b) for a, b in zip(old, new)] + new[len(old):]
    elif type(old) is dict and type(new) is dict:
        before = dict(old)
        old.clear()
        old.update((k, merged(before[k], v) if k in before else v) for k, v in new.items())
    elif type(old) is set and type(new) is set:
        old.clear()
        old.update(new)
    elif isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        for a, b in zip(old, new):
            merged(a, b)


class Link:
    """The tests' end of the channel to the candidate's process. Anything but a well-formed reply
    (the process went away, a malformed message, a value that cannot be rebuilt) fails the run at
    once through `fail`, so that no test can catch it and go on: the program itself caused it."""

    def __init__(self, channel, fail, failures, nan_expected):
        self.channel, self.fail, self.failures, self.nan_expected = channel, fail, failures, nan_expected
        self.remotes = {}  # one proxy per object of the program's
        self.comparing = set()  # pairs of objects being compared: a cycle compares equal (as a bisimulation)
        self.kinds = {**_CONTAINERS, "tuple": CandidateTuple}

    def reference(self, message):
        index = message.get("id")
        if type(index) is not int:
            raise ProtocolError("bad handle")
        if index not in self.remotes:
            kind = RemoteIterator if message.get("iter") is True else Remote
            self.remotes[index] = kind(self, index, str(message.get("type"))[:100])
        return self.remotes[index]

    def encode(self, value):
        def handle(obj):
            if isinstance(obj, Remote):
                return {"$": "ref", "id": obj._id}
            if type(obj) is CandidateTuple:
                return encode(tuple(obj), handle)
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
            value = decode(data, self.reference, kinds=self.kinds)
        except BaseException as exc:  # noqa: BLE001
            self.fail(f"the program under test: {describe(exc)}")
        if not self.nan_expected and _has_nan(value):
            self.failures.record("the program under test returned NaN, which the tests do not expect")
        return value

    def exchange(self, message):
        try:
            self.channel.send(message)
        except OSError as exc:
            self.fail(f"the program under test: {describe(exc)}")
        reply = self.receive()
        if "raise" in reply:
            raise relayed(reply["raise"])
        if "value" not in reply:
            self.fail("malformed reply")
        return reply

    def request(self, message):
        return self.value(self.exchange(message)["value"])

    def call(self, target, args, kwargs):
        reply = self.exchange({"op": "call", "target": target, "args": self.encode(list(args)),
                               "kwargs": self.encode(dict(kwargs))})
        value = self.value(reply["value"])
        after = self.value(reply["after"]) if value is None and "after" in reply else None
        if type(after) is dict and type(after.get("args")) is list and type(after.get("kwargs")) is dict:
            for old, new in zip(args, after["args"]):
                _sync(old, new)
            for name, old in kwargs.items():
                _sync(old, after["kwargs"].get(name))
        return value

    def next(self, target, count):
        reply = self.exchange({"op": "next", "target": target, "count": count})
        items = self.value(reply["value"])
        if type(items) is not list:
            self.fail("malformed reply")
        return items, reply.get("done") is True

    def same_state(self, a, b):
        pair = (a._id, b._id)
        if pair in self.comparing:
            return True
        self.comparing.add(pair)
        try:  # both states are read whatever they hold, then compared here
            first = self.request({"op": "state", "target": a._id})
            second = self.request({"op": "state", "target": b._id})
            if type(first) is not dict or type(second) is not dict:
                return False
            return all(first.get(key) == second.get(key) for key in ("class", "value", "attributes"))
        finally:
            self.comparing.discard(pair)
