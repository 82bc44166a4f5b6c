"""The package's import direction (docs/architecture.md, "Layers"): every import inside dare_core,
including those inside functions, goes to the importer's own layer or an earlier one; the module
graph has no cycle; dare_core never imports Prefect, DVC, `tasks/` or `flows/`; `tasks/` never
imports `flows/`."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dare_core"
sys.path.insert(0, str(ROOT / "scripts"))  # the import graph is the structure review's (scripts/house_numbers.py)

from house_numbers import circles, imports, modules  # noqa: E402


def layer_order() -> list[list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    return [line.split() for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules(ROOT, PACKAGE)
    return {name: imports(name, path, known) for name, path in known.items()}


def layer_of(module: str, order: list[list[str]]) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__package__"
    if key == "__package__":
        return 0  # dare_core/__init__.py: the version string, nothing else
    for index, names in enumerate(order):
        if key in names:
            return index
    raise AssertionError(f"{module}: its layer '{key}' is not in docs/architecture.md's layers block")


def test_every_module_has_a_layer(graph):
    order = layer_order()
    for module in graph:
        layer_of(module, order)


def test_imports_point_down(graph):
    order = layer_order()
    upward = []
    for module, targets in graph.items():
        mine = layer_of(module, order)
        for target in targets:
            if (target == PACKAGE or target.startswith(PACKAGE + ".")) and target in graph:
                theirs = layer_of(target, order)
                if theirs > mine:
                    upward.append(f"{module} ({' '.join(order[mine])}) imports {target} ({' '.join(order[theirs])})")
    assert not upward, "imports against the layer order:\n" + "\n".join(sorted(upward))


def test_no_import_cycle(graph):
    """No cycle, also through a type named only for annotations (an import that never runs still ties
    the two modules: neither can be read or moved without the other)."""
    inside = {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}
    cycles = circles(sorted(inside), inside)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_library_never_imports_the_orchestration(graph):
    forbidden = ("prefect", "dvc", "tasks", "flows")
    bad = sorted(f"{m} imports {t}" for m, ts in graph.items() for t in ts if t.split(".")[0] in forbidden)
    assert not bad, "\n".join(bad)


def test_tasks_never_import_flows():
    known = modules(ROOT, "tasks")
    bad = sorted(f"{m} imports {t}" for m, p in known.items() for t in imports(m, p, known) if t.split(".")[0] == "flows")
    assert not bad, "\n".join(bad)


def test_checker_sees_a_cycle():
    assert circles(["a", "b", "c", "d"], {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles(["a", "b"], {"a": {"b"}}) == []


def test_checker_sees_an_upward_import(tmp_path):
    # the checker itself: an import from `training` inside a `models` function is caught
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from dare_core.training.engine import build_engine\n")
    order = layer_order()
    found = imports("dare_core.models.x", fake, {})
    assert any(layer_of(t, order) > layer_of("dare_core.models.x", order) for t in found if t.startswith(PACKAGE + "."))
