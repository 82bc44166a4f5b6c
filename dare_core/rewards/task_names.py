"""Which names of the program under test its tests may use, decided from the task alone.

The tests run in a jail of their own against proxies of the program's names (`sandbox.run_python`).
Which names become proxies is the task's choice, never the program's: the program could otherwise
hand the tests its own `__builtins__`, a module the tests use, or a helper of the task.

- A declared entry point (`entry_point`, `fn_name`) is the program's, even where it is named like a
  builtin (`max`): the tests then mean the program's function, not Python's.
- Without one, the program's names are those the tests use but never bind themselves (at any scope,
  found with `symtable`), leaving out builtins (always the tests' own) and names of standard-library
  modules (the tests' own import, never a proxy).
- Names the tests import from `solution` (`from solution import f`, `solution.f`) are the program's.
- Helpers the task's prompt defines (HumanEval/32's `poly`, /38's `encode_cyclic`) run in the
  tests' jail from the prompt's own code, so the tests use the task's version of them.
"""
from __future__ import annotations

import ast
import builtins
import symtable
import sys
from typing import Iterable, Optional

from dare_core.rewards.extract import python_blocks

BUILTINS = frozenset(vars(builtins))
MODULES = frozenset(sys.stdlib_module_names)


def _tables(table: symtable.SymbolTable) -> Iterable[symtable.SymbolTable]:
    yield table
    for child in table.get_children():
        yield from _tables(child)


def used_names(source: str) -> tuple[set[str], set[str]]:
    """(names the code uses without binding them anywhere, names it imports from module `solution`).
    Code that does not compile uses nothing (it fails in the jail anyway)."""
    try:
        top = symtable.symtable(source, "tests", "exec")
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return set(), set()
    bound, used = set(), set()
    for table in _tables(top):
        for symbol in table.get_symbols():
            name = symbol.get_name()
            binds = symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace()
            if table is top and binds or symbol.is_declared_global() and binds:
                bound.add(name)
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                used.add(name)
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


def names_for(tests: str, declared: Optional[Iterable[str]] = None) -> tuple[list[str], list[str]]:
    """(the program's names the tests may use, standard-library modules to import in the tests'
    jail for the modules they use without importing). `declared`: the task's entry points; None
    leaves the choice to the rule above."""
    free, imported = used_names(tests)
    names = set(declared) if declared is not None else {n for n in free if n not in MODULES}
    # a dunder is never the program's (`__builtins__`, `__name__`), whoever names it
    names = {n for n in names | imported if n.isidentifier() and not n.startswith("__")}
    return sorted(names), sorted(n for n in free if n in MODULES and n not in names)
