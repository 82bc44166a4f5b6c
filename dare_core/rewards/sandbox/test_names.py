"""Which names of the program under test its tests may use: the names the tests' jail gets as
proxies of the program's (`sandbox.run_python`), decided from the tests and the problem alone,
never from the program (which could otherwise hand the tests its own `__builtins__`, a module the
tests use, or a helper of the problem's).

- A declared entry point (`entry_point`, `fn_name`) is the program's, even where it is named like a
  builtin (`max`): the tests then mean the program's function, not Python's.
- Without one, the program's names are those the tests use but never bind themselves (at any scope,
  found with `symtable`), leaving out builtins (always the tests' own) and names of standard-library
  modules (the tests' own import, never a proxy).
- Names the tests import from `solution` (`from solution import f`, `solution.f`) are the program's.

Which builtin-named functions a problem means as the program's, and the helpers its prompt defines,
are read from the problem's prompt by the code reward (`dare_core.rewards.problem_names`).
"""
from __future__ import annotations

import ast
import builtins
import symtable
import sys
from typing import Iterable, Optional

BUILTINS = frozenset(vars(builtins))
MODULES = frozenset(sys.stdlib_module_names)


def _tables(table: symtable.SymbolTable) -> Iterable[symtable.SymbolTable]:
    yield table
    for child in table.get_children():
        yield from _tables(child)


def bindings(source: str) -> Optional[tuple[ast.Module, set[str], set[str]]]:
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
    found = bindings(source)
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


def names_for(tests: str, declared: Optional[Iterable[str]] = None) -> tuple[list[str], list[str]]:
    """(the program's names the tests may use, standard-library modules to import in the tests'
    jail for the modules they use without importing). `declared`: the problem's entry points; None
    leaves the choice to the rule above."""
    free, imported = used_names(tests)
    names = set(declared) if declared is not None else {n for n in free if n not in MODULES}
    # a dunder is never the program's (`__builtins__`, `__name__`), whoever names it
    names = {n for n in names | imported if n.isidentifier() and not n.startswith("__")}
    return sorted(names), sorted(n for n in free if n in MODULES and n not in names)
