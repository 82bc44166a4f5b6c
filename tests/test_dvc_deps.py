"""dvc.yaml's code dependencies are complete: every dare_core file a stage can execute or read lies
under one of the stage's `deps`, so DVC re-runs a stage whenever code it runs has changed.

What a stage runs is computed from the code, not listed here: the stage's entry points come from
`dare_core.cli` (the `dare` command, and `STAGES`, which names the worker module `dare stage <name>`
imports in process or starts under the launcher), then the static import closure over dare_core:

- every `import` / `from ... import` anywhere in a module (function bodies included; not the body
  of `if TYPE_CHECKING:`, which never runs), `from X import name` counting as module `X.name` when
  that is a module, and relative imports resolved;
- every parent package's `__init__.py` of an imported module (Python executes them first);
- string literals naming a dare_core module (`"dare_core.eval.opencompass"`), which is how modules
  are imported lazily (`importlib.import_module`) or by another process (OpenCompass configs name
  classes by dotted path);
- files a module reads next to itself (`Path(__file__).with_name("x.py")`): in a module using
  `__file__`, any string literal naming a file in its folder.

Of cli.py itself only what `dare stage` runs counts: its module-level imports and the functions
reachable by calls from `main` and the stage command's handler (not `dare eval` or `dare generate`,
whose imports are no stage's business).
"""
from __future__ import annotations

import ast
import fnmatch
import re
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "dare_core"
CLI = f"{PACKAGE}.cli"
MODULE_NAME = re.compile(rf"{PACKAGE}(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _stages() -> dict:
    """The `dare stage` stages (input_file, a foreach over data/input_files.yaml, only depends on the
    user's files: tests/dare_core/test_inputs.py)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    return {name: body for name, body in stages.items() if "foreach" not in body}


def module_file(name: str) -> Path | None:
    """The source file of dotted module `name` in this repository, or None if it is not one."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _is_package(name: str) -> bool:
    path = module_file(name)
    return path is not None and path.name == "__init__.py"


@lru_cache(maxsize=None)
def _tree(name: str) -> ast.Module:
    path = module_file(name)
    return ast.parse(path.read_text(), filename=str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST):
    """ast.walk, minus the bodies of `if TYPE_CHECKING:` (annotations only; never executed)."""
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _package_of(name: str) -> str:
    return name if _is_package(name) else name.rpartition(".")[0]


def _imports_in(nodes, importer: str) -> set[str]:
    """dare_core modules named by the import statements and dotted-name strings within `nodes`."""
    found: set[str] = set()
    for top in nodes:
        for node in _walk(top):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _package_of(importer)
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
                # a module by name ("pkg.mod"), or a class by dotted path ("pkg.mod.Class")
                parts = node.value.split(".")
                for end in range(len(parts), 0, -1):
                    if module_file(".".join(parts[:end])):
                        found.add(".".join(parts[:end]))
                        break
    return {n for n in found if (n == PACKAGE or n.startswith(PACKAGE + ".")) and module_file(n)}


def _data_files(name: str) -> set[Path]:
    """Files next to module `name` that it names in a string literal, when it locates itself by
    `__file__` (e.g. `Path(__file__).with_name("_math_worker.py").read_text()`)."""
    tree = _tree(name)
    if not any(isinstance(n, ast.Name) and n.id == "__file__" for n in _walk(tree)):
        return set()
    folder = module_file(name).parent
    found = set()
    for node in _walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value and "\n" not in node.value:
            candidate = folder / node.value
            try:
                if candidate.is_file() and folder in candidate.resolve().parents:
                    found.add(candidate)
            except OSError:  # not a path at all (too long, odd characters)
                pass
    return found


def _cli_stage_imports() -> set[str]:
    """What cli.py imports when it runs `dare stage <name>`: its module-level imports, and the
    imports in the functions that `main` and the `stage` handler call, transitively."""
    import dare_core.cli as cli

    handler = cli.build_parser().parse_args(["stage", next(iter(cli.STAGES))]).func
    tree = _tree(CLI)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert "main" in functions and handler.__name__ in functions, "dare_core/cli.py: no main() or stage handler found"
    todo, reached = ["main", handler.__name__], set()
    while todo:
        fn = todo.pop()
        if fn in reached:
            continue
        reached.add(fn)
        for node in _walk(functions[fn]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
                todo.append(node.func.id)
    module_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.If, ast.Try))]
    return _imports_in(module_level + [functions[fn] for fn in sorted(reached)], CLI)


def stage_entry_modules(stage: str) -> set[str]:
    """The modules `dare stage <stage>` starts from: the cli, and the worker it dispatches to (imported
    in process, or run with `python -m` under the launcher)."""
    from dare_core.cli import STAGES

    worker = STAGES[stage][0]
    assert module_file(worker), f"dare_core.cli.STAGES['{stage}'] names {worker}, which has no source file"
    return {CLI, worker}


def _with_parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


def stage_files(stage: str) -> set[str]:
    """Every dare_core file (repo-relative) that `dare stage <stage>` can import or read."""
    todo = [m for entry in stage_entry_modules(stage) for m in _with_parents(entry)]
    todo += [m for imported in _cli_stage_imports() for m in _with_parents(imported)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name == CLI:
            continue  # its imports: _cli_stage_imports, already queued
        for imported in _imports_in([_tree(name)], name):
            todo.extend(_with_parents(imported))
    files = {module_file(name) for name in seen}
    files |= {path for name in seen for path in _data_files(name)}
    return {path.relative_to(REPO).as_posix() for path in files}


def code_deps(stage: dict) -> list[str]:
    """The stage's deps that are paths in this repository (not `${...}` data paths)."""
    deps = [next(iter(d)) if isinstance(d, dict) else d for d in stage.get("deps", [])]
    return [d.rstrip("/") for d in deps if "${" not in d]


def covers(dep: str, path: str) -> bool:
    return path == dep or path.startswith(dep + "/")


STAGE_NAMES = list(_stages())


def test_every_dvc_stage_is_a_cli_stage():
    from dare_core.cli import STAGES

    assert set(STAGE_NAMES) <= set(STAGES), f"dvc.yaml stages {sorted(set(STAGE_NAMES) - set(STAGES))} are not `dare stage` names"


def test_every_stage_depends_on_the_code_it_runs():
    stages = _stages()
    missing = {}
    for name, stage in stages.items():
        deps = code_deps(stage)
        uncovered = sorted(p for p in stage_files(name) if not any(covers(d, p) for d in deps))
        if uncovered:
            missing[name] = uncovered
    assert not missing, "dvc.yaml stages do not depend on code they import or read (add to `deps:`):\n" + "\n".join(
        f"  {name} -> {', '.join(paths)}" for name, paths in missing.items())


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_code_deps_exist_and_are_used(stage):
    """A code dep that is gone breaks `dvc repro`; one the stage never imports re-runs it for nothing."""
    files = stage_files(stage)
    for dep in code_deps(_stages()[stage]):
        assert (REPO / dep).exists(), f"dvc.yaml stage '{stage}' depends on {dep}, which does not exist"
        if dep == PACKAGE or dep.startswith(PACKAGE + "/"):
            assert any(covers(dep, p) for p in files), (
                f"dvc.yaml stage '{stage}' depends on {dep}, but `dare stage {stage}` never imports or reads anything in it")


def test_no_code_dep_holds_an_empty_file():
    """DVC warns about every empty file a stage depends on, on every command (an empty __init__.py)."""
    empty = sorted({str(f.relative_to(REPO)) for stage in _stages().values() for dep in code_deps(stage)
                    for f in ([REPO / dep] if (REPO / dep).is_file() else (REPO / dep).rglob("*"))
                    if f.is_file() and f.stat().st_size == 0 and "__pycache__" not in f.parts})
    assert not empty, f"empty files that dvc.yaml stages depend on (give each a docstring): {empty}"


def test_package_data_files_are_found_by_the_closure():
    """Non-Python files shipped in dare_core (pyproject package-data) count for a stage only when the
    rule in _data_files sees them being read; one read some other way needs that rule extended."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config.get("tool", {}).get("setuptools", {}).get("package-data", {}).get(PACKAGE, [])
    root = REPO / PACKAGE
    shipped = {p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".py"
               and any(fnmatch.fnmatch(p.relative_to(root).as_posix(), pat.replace("**/", "*")) for pat in patterns)}
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in root.rglob("*.py")
               if "__pycache__" not in p.parts}
    found = {path for name in modules for path in _data_files(name)}
    unseen = sorted(p.relative_to(REPO).as_posix() for p in shipped - found)
    assert not unseen, f"package data no module is seen reading (extend _data_files in this test): {unseen}"


def test_closure_finds_what_the_rules_promise():
    """The closure rules themselves, on facts of this code base that each rule exists for."""
    prepare, rl, eval_ = stage_files("prepare"), stage_files("rl"), stage_files("eval")
    assert {"dare_core/__init__.py", "dare_core/cli.py", "dare_core/workers/__init__.py",
            "dare_core/workers/prepare.py", "dare_core/workers/common.py"} <= prepare
    assert "dare_core/algorithms/__init__.py" not in prepare  # prepare never trains
    assert "dare_core/eval/validation.py" in rl  # in-loop validation, imported inside a function
    assert "dare_core/eval/opencompass.py" in eval_  # named by a string, imported by OpenCompass
    assert "dare_core/eval/runner.py" not in rl  # `dare eval`'s import in cli.py is not the stage's
