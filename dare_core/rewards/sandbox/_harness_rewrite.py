"""No oracle: the tests are rewritten so that every check of theirs runs, whatever the earlier ones
found (role `tests`, in the tests' jail; loaded by `_sandbox_child.py`).

If a failed check ended the run, the program would learn from the next request (or its absence)
that its last answer passed. So, before the tests run, their syntax tree is changed:
- every `assert` records its failure and goes on (`if not test: failed(line)`); its message is not
  evaluated, since a message computed only on failure could call the program;
- `and`/`or` in an assert evaluate every operand, then give Python's result (an operand's error is
  raised where Python would have reached it); `all()` and `any()` take every item first;
- at the top level and in the bodies of test functions (`test*` and `check` at the top level,
  `test*` methods of top-level classes) each statement is guarded: an exception leaving it is a
  recorded failure, and the next statement runs. So is a statement that fails only because an
  earlier check failed (an index past a short answer). In the body of a `try` or `with`, only an
  AssertionError is caught there (the tests' own failure: the program's never arrives as one), so
  `pytest.raises`, `assertRaises` and `except ValueError` still see the exceptions they expect; in
  the body of a `try` that catches AssertionError itself nothing changes.
Helper functions of the tests keep Python's semantics apart from their asserts: an exception
leaving one ends it, and the caller's guarded statement records it.
"""
import ast
import sys

NONE, ASSERTIONS, ALL = 0, 1, 2  # what a guard catches around each statement of a body
_CATCH_ASSERTION = {"AssertionError", "Exception", "BaseException"}
_UNGUARDED = (ast.Global, ast.Nonlocal, ast.Pass)


def _catches_assertion(handlers):
    for handler in handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        for kind in kinds:
            name = kind.attr if isinstance(kind, ast.Attribute) else getattr(kind, "id", None)
            if kind is None or name is None or name in _CATCH_ASSERTION:
                return True
    return False


def _name(identifier):
    return ast.Name(identifier, ast.Load())


class _EagerBool(ast.NodeTransformer):
    """`a and b` -> `__dare_and__(lambda: a, lambda: b)`, where a lambda keeps Python's meaning."""

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        for inner in ast.walk(node):
            if isinstance(inner, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)) or (
                    isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "super"):
                return node
        thunks = [ast.Lambda(ast.arguments([], [], None, [], [], None, []), value) for value in node.values]
        helper = "__dare_and__" if isinstance(node.op, ast.And) else "__dare_or__"
        return ast.copy_location(ast.Call(_name(helper), thunks, []), node)


class _Rewrite:
    def body(self, statements, level, asserts, scope):
        out = [self.statement(node, level, asserts, scope) for node in statements]
        return out or [ast.Pass()]

    def statement(self, node, level, asserts, scope):
        if isinstance(node, ast.Assert):
            node = self.check(node, scope) if asserts else node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            test = (scope == "module" and (node.name == "check" or node.name.startswith("test"))
                    or scope == "class" and node.name.startswith("test"))
            node.body = self.body(node.body, ALL if test else NONE, True, "function")
        elif isinstance(node, ast.ClassDef):
            node.body = self.body(node.body, NONE, True, "class" if scope == "module" else "nested")
        elif isinstance(node, (ast.Try, ast.TryStar)):
            caught = _catches_assertion(node.handlers)
            node.body = self.body(node.body, NONE if caught else min(level, ASSERTIONS), asserts and not caught, scope)
            for handler in node.handlers:
                handler.body = self.body(handler.body, level, asserts, scope)
            node.orelse = self.body(node.orelse, level, asserts, scope) if node.orelse else []
            node.finalbody = self.body(node.finalbody, level, asserts, scope) if node.finalbody else []
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            node.body = self.body(node.body, min(level, ASSERTIONS), asserts, scope)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While, ast.If)):
            node.body = self.body(node.body, level, asserts, scope)
            node.orelse = self.body(node.orelse, level, asserts, scope) if node.orelse else []
        elif isinstance(node, ast.Match):
            for case in node.cases:
                case.body = self.body(case.body, level, asserts, scope)
        if not level or isinstance(node, _UNGUARDED) or self.fixed(node):
            return node
        return self.guard(node, level)

    @staticmethod
    def fixed(node):  # a docstring, or `from __future__ import`, which must stay where it is
        return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                or isinstance(node, ast.ImportFrom) and node.module == "__future__")

    def check(self, node, scope):
        test = node.test if scope in ("class", "nested") else _EagerBool().visit(node.test)
        message = node.msg.value if isinstance(node.msg, ast.Constant) and type(node.msg.value) is str else None
        failed = ast.Call(_name("__dare_failed__"), [ast.Constant(node.lineno), ast.Constant(message)], [])
        return ast.copy_location(ast.If(ast.UnaryOp(ast.Not(), test), [ast.Expr(failed)], []), node)

    @staticmethod
    def guard(node, level):
        def handler(kind, helper):
            call = ast.Call(_name(helper), [_name("__dare_error__")], [])
            return ast.ExceptHandler(_name(kind), "__dare_error__", [ast.Expr(call)])

        handlers = [handler("AssertionError", "__dare_caught__")]
        if level == ALL:
            handlers = [handler("Exception", "__dare_caught__"), handler("SystemExit", "__dare_exit__")]
        return ast.copy_location(ast.Try([node], handlers, [], []), node)


def rewrite(tree):
    """The tests' module `tree`, rewritten as the module docstring says."""
    tree.body = _Rewrite().body(tree.body, ALL, True, "module")
    return ast.fix_missing_locations(tree)


def _eager(is_and, thunks):
    results = []
    for thunk in thunks:
        try:
            results.append((True, thunk()))
        except Exception as exc:  # noqa: BLE001  (raised below, where Python would have met it)
            results.append((False, exc))
    for ok, value in results:
        if not ok:
            raise value
        if bool(value) != is_and:
            return value
    return results[-1][1]


def _items(iterable):
    """Every item, and the error that ended the iteration early (None if it ran out)."""
    items, iterator = [], iter(iterable)
    while True:
        try:
            items.append(next(iterator))
        except StopIteration:
            return items, None
        except Exception as exc:  # noqa: BLE001
            return items, exc


def eager_all(iterable):
    items, error = _items(iterable)
    for item in items:
        if not item:
            return False
    if error is not None:
        raise error
    return True


def eager_any(iterable):
    items, error = _items(iterable)
    for item in items:
        if item:
            return True
    if error is not None:
        raise error
    return False


def helpers(failures, source):
    """The names the rewritten tests call, bound to `failures` (lines of `source` name a failed assert)."""
    lines = source.splitlines()

    def failed(line, message):
        text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        failures.record(f"AssertionError at line {line}: {message or text}"[:500])

    def caught(error):
        unittest = sys.modules.get("unittest")
        if unittest is not None and isinstance(error, unittest.SkipTest):  # a skip, not a failure
            raise error
        failures.record(error)

    def exited(error):  # the tests' own sys.exit(): a failure unless it says success
        if error.code not in (None, 0):
            failures.record(error)
            return
        raise error

    return {"__dare_failed__": failed, "__dare_caught__": caught, "__dare_exit__": exited,
            "__dare_and__": lambda *thunks: _eager(True, thunks), "__dare_or__": lambda *thunks: _eager(False, thunks),
            "all": eager_all, "any": eager_any}
