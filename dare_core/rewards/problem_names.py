"""Which names of a coding problem's program its tests mean, read from the problem's prompt and the
program's text (the general rule, from the tests alone, is the sandbox's: `sandbox/test_names.py`).

- Builtin functions the tests call are the program's in two cases the problem decides
  (`builtin_entries`): the prompt leaves a function of that name for the program to write (a stub),
  or the tests use no other name of the program's (without it they would check Python's own `max`,
  and every answer would pass). In the second case the program's are those it defines (read from its
  text), and one of them must be there.
- Helpers the problem's prompt defines (HumanEval/32's `poly`, /38's `encode_cyclic`) run in the
  tests' jail from the prompt's own code, so the tests use the problem's version of them.
"""
from __future__ import annotations

import ast
import builtins
import types
from typing import Iterable, Optional

from dare_core.rewards.extract import python_blocks
from dare_core.rewards.sandbox.test_names import bindings

FUNCTIONS = frozenset(n for n, v in vars(builtins).items() if isinstance(v, types.BuiltinFunctionType))


def builtins_called(source: str) -> set[str]:
    """Builtin functions (`max`, `sum`, not classes such as `list`) that the code calls by a name it
    never binds itself."""
    found = bindings(source)
    if found is None:
        return set()
    tree, bound, used = found
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    return {n for n in called & used - bound
            if n in FUNCTIONS and not n.startswith("__")}


def top_level_names(program: str) -> set[str]:
    """Names the program binds at its top level (in `if`/`try`/`with`/loop bodies too), read from its
    text: what it defines, before it runs. Text that does not parse binds nothing."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        target = getattr(node, "target", None)  # of AnnAssign, AugAssign, for
        for bound in [*(getattr(node, "targets", None) or ()), *([target] if isinstance(target, ast.AST) else [])]:
            names.update(n.id for n in ast.walk(bound) if isinstance(n, ast.Name))
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(item for item in getattr(node, field, None) or () if isinstance(item, ast.AST))
    return names


def builtin_entries(tests: str, program: str, stubs: Iterable[str], others: bool) -> list[str]:
    """The builtin-named functions of the program's that the tests mean (they then call the
    program's, which must exist), for a problem that declares no entry point: those the tests call
    that the prompt leaves for the program to write (`stubs`); else, only when the tests use no
    other name of the program's (`others` False, so without one they would test Python itself),
    those of them the program defines, or, if it defines none of them, all of them."""
    called = builtins_called(tests)
    declared = called & set(stubs)
    if declared or others:
        return sorted(declared)
    return sorted(called & top_level_names(program) or called)


def _is_stub(node: ast.stmt) -> bool:
    """A definition left for the program to write: only a docstring, `pass` or `...` in its body."""
    if isinstance(node, ast.ClassDef):
        return all(_is_stub(item) for item in node.body)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return all(_is_stub(item) for item in node.body)
    return isinstance(node, ast.Pass) or isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def prompt_helpers(prompt: Optional[str], keep_out: Iterable[str]) -> tuple[str, set[str]]:
    """(code, names) of the helpers the prompt defines: its imports and its functions and classes
    with a body, from its fenced Python blocks (else the whole prompt, when it is Python). Stubs, the
    names in `keep_out` (the program's) and `test*` names (they would run as tests) are left out;
    statements that run code (asserts, examples) never run."""
    if not prompt:
        return "", set()
    keep_out, parts, names = set(keep_out), [], set()
    for block in python_blocks(prompt) or [prompt]:
        try:
            tree = ast.parse(block)
        except (SyntaxError, ValueError, RecursionError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "solution":
                # a module missing from the jail leaves the helpers that need it failing, not the tests
                parts.append("try:\n    " + ast.unparse(node) + "\nexcept ImportError:\n    pass")
            elif (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not _is_stub(node)
                  and node.name not in keep_out and not node.name.lower().startswith("test")):
                parts.append(ast.unparse(node))
                names.add(node.name)
    return "\n\n".join(parts), names


def prompt_stubs(prompt: Optional[str]) -> set[str]:
    """Names of the functions and classes the prompt's code leaves for the program to write (stubs)."""
    stubs = set()
    for block in python_blocks(prompt or "") or [prompt or ""]:
        try:
            tree = ast.parse(block)
        except (SyntaxError, ValueError, RecursionError):
            continue
        stubs.update(node.name for node in tree.body
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_stub(node))
    return stubs


