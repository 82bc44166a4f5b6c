"""The candidate's side of a test run (role `serve`), loaded by `_sandbox_child.py` into the
candidate's jail before the program runs; the tests' side is `_harness_values.py`.

It executes the program as module `solution`, sends the values of the names its job lists, then
answers the tests' requests: call a handle, read an attribute, iterate, take the next items of an
iterator, describe an instance's state. Everything in this process is under the candidate's control
(its program can reach this code, the channel and every object here), so nothing sent from here is
trusted by the tests' side: it is data, rebuilt there as plain values and proxies.
"""
import sys
import types

from __main__ import Channel, ProtocolError, decode, describe, encode, flush

# containers the tests pass by value: a call that returns None sends their new contents back, for
# tests that check an argument the program changed in place
_MUTABLE = (list, dict, set)
# the builtin value of an instance of a class of the program's that subclasses one (a namedtuple)
_PLAIN_BASES = (int, float, complex, str, bytes, tuple, list, dict, set, frozenset)
NEXT_MAX = 4096  # items of an iterator per request


def _is_iterator(value):
    kind = type(value)
    return hasattr(kind, "__next__") and hasattr(kind, "__iter__")


def _holds_mutable(values):
    return any(type(v) in _MUTABLE or type(v) is tuple and any(type(i) in _MUTABLE for i in v) for v in values)


def _state(target):
    """What the tests compare two instances of the program's own classes by: class, attributes and
    builtin value. None for anything else (functions, classes, builtin objects): those compare by
    identity only, since a builtin object's state is not in its attributes."""
    kind = type(target)
    if getattr(kind, "__module__", None) != "solution" or isinstance(target, type):
        return None
    attributes = dict(getattr(target, "__dict__", None) or {})
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(target, name):
                attributes[name] = getattr(target, name)
    base = next((b for b in _PLAIN_BASES if isinstance(target, b)), None)
    return {"class": kind, "attributes": attributes, "value": base(target) if base else None}


def serve(job, program):
    channel = Channel(job["channel"][0], job["channel"][1])
    objects, ids, pending = [], {}, {}

    def handle(value):
        # one id per object (each is kept alive in `objects`, so its id() is not reused): the tests
        # see the same object of the program's as the same proxy
        index = ids.get(id(value))
        if index is None:
            objects.append(value)
            index = ids[id(value)] = len(objects) - 1
        ref = {"$": "ref", "id": index, "type": str(type(value).__name__)}
        if _is_iterator(value):
            ref["iter"] = True
        return ref

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
            reply = _answer(request, reference, handle, pending)
        except BaseException as exc:  # noqa: BLE001
            reply = {"raise": {"type": type(exc).__name__, "message": describe(exc)}}
        flush()  # the program's output reaches the caller even when the jail is killed after the tests
        channel.send(reply)


def _answer(request, reference, handle, pending):
    index, op = request["target"], request["op"]
    target = reference({"id": index})
    if op == "call":
        args = decode(request["args"], reference)
        kwargs = decode(request["kwargs"], reference)
        value = target(*args, **kwargs)
        reply = {"value": encode(value, handle)}
        if value is None and _holds_mutable([*args, *kwargs.values()]):
            # an answer given in place: the tests' side copies the new contents into its own objects
            reply["after"] = encode({"args": args, "kwargs": kwargs}, handle)
        return reply
    if op == "next":
        if index in pending:
            raise pending.pop(index)
        items, done = [], False
        for _ in range(max(1, min(int(request.get("count", 1)), NEXT_MAX))):
            try:
                items.append(next(target))
            except StopIteration:
                done = True
                break
            except BaseException as exc:  # noqa: BLE001
                if not items:
                    raise
                pending[index] = exc  # raised at the next request, after the items that came before it
                break
        return {"value": encode(items, handle), "done": done}
    if op == "iter":
        return {"value": encode(iter(target), handle)}
    if op == "state":
        return {"value": encode(_state(target), handle)}
    return {"value": encode(getattr(target, request["name"]), handle)}
