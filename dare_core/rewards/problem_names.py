"""Which names of the program under test its tests may use, decided from the problem alone.

The tests run in a jail of their own against proxies of the program's names (`sandbox.run_python`).
Which names become proxies is the problem's choice, never the program's: the program could otherwise
hand the tests its own `__builtins__`, a module the tests use, or a helper of the problem.

- A declared entry point (`entry_point`, `fn_name`) is the program's, even where it is named like a
  builtin (`max`): the tests then mean the program's function, not Python's.
- Without one, the program's names are those the tests use but never bind themselves (at any scope,
  found with `symtable`), leaving out builtins (always the tests' own) and names of standard-library
  modules (the tests' own import, never a proxy).
- Builtin functions the tests call are the program's in two cases the problem decides
  (`builtin_entries`): the prompt leaves a function of that name for the program to write (a stub),
  or the tests use no other name of the program's (without it they would check Python's own `max`,
  and every answer would pass). In the second case the program's are those it defines (read from its
  text), and one of them must be there.
- Names the tests import from `solution` (`from solution import f`, `solution.f`) are the program's.
- Helpers the problem's prompt defines (HumanEval/32's `poly`, /38's `encode_cyclic`) run in the
  tests' jail from the prompt's own code, so the tests use the problem's version of them.
"""
from __future__ import annotations

import ast
import builtins
import symtable
import sys
import types
from typing import Iterable, Optional

from dare_core.rewards.extract import python_blocks

BUILTINS = frozenset(vars(builtins))
FUNCTIONS = frozenset(n for n, v in vars(builtins).items() if isinstance(v, types.BuiltinFunctionType))
MODULES = frozenset(sys.stdlib_module_names)


def _tables(table: symtable.SymbolTable) -> Iterable[symtable.SymbolTable]:
    yield table
    for child in table.get_children():
        yield from _tables(child)


def _bindings(source: str) -> Optional[tuple[ast.Module, set[str], set[str]]]:
    """(tree, names bound at the top level or declared global, names used at the top level or as
    globals) of `source`; None when it does not compile."""
    try:
        top = symtable.symtable(source, "tests", "exec")
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return None
    bound, used = set(), set()
    for table in _tables(top):
        for symbol in table.get_symbols():
            name = symbol.get_name()
            binds = symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace()
            if table is top and binds or symbol.is_declared_global() and binds:
                bound.add(name)
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                used.add(name)
    return tree, bound, used


def used_names(source: str) -> tuple[set[str], set[str]]:
    """(names the code uses without binding them anywhere, names it imports from module `solution`).
    Code that does not compile uses nothing (it fails in the jail anyway)."""
    found = _bindings(source)
    if found is None:
        return set(), set()
    tree, bound, used = found
    imported, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "solution" and not node.level:
            imported.update(alias.name for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Import):
            aliases.update(alias.asname or alias.name for alias in node.names if alias.name == "solution")
    for node in ast.walk(tree):  # `solution.f` after `import solution`
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            imported.add(node.attr)
    free = {n for n in used - bound if n not in BUILTINS and not n.startswith("__")}
    return free, imported


def builtins_called(source: str) -> set[str]:
    """Builtin functions (`max`, `sum`, not classes such as `list`) that the code calls by a name it
    never binds itself."""
    found = _bindings(source)
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


def names_for(tests: str, declared: Optional[Iterable[str]] = None) -> tuple[list[str], list[str]]:
    """(the program's names the tests may use, standard-library modules to import in the tests'
    jail for the modules they use without importing). `declared`: the problem's entry points; None
    leaves the choice to the rule above."""
    free, imported = used_names(tests)
    names = set(declared) if declared is not None else {n for n in free if n not in MODULES}
    # a dunder is never the program's (`__builtins__`, `__name__`), whoever names it
    names = {n for n in names | imported if n.isidentifier() and not n.startswith("__")}
    return sorted(names), sorted(n for n in free if n in MODULES and n not in names)
