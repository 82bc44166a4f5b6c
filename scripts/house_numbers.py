"""The numbers of a structure review of `dare_core`, for one checkout:
`python scripts/house_numbers.py [--repo PATH] [--walk]`.

- **rooms**: the top-level modules and the (sub-)packages of `dare_core`; a module belongs to its
  innermost package. **lines**: the package's Python lines.
- **arrows**: ordered pairs of rooms (A, B), A != B, where a module of A imports one of B, imports
  inside functions and under `TYPE_CHECKING` included (a type-only import still ties two rooms).
- **circles**: the groups of rooms that reach each other through arrows (strongly connected
  components of more than one room). **floors**: the rooms on the longest chain of arrows, circles
  counted as one room.
- **walk** (`--walk`): the RL stage's way from its start to loading the model, traced on a tiny
  project (prepared and SFT-trained through `dare stage`): the rooms its calls enter, and the
  distinct (caller's room, callee's room) pairs of its calls between two rooms ("crossings"); the
  same for modules.
- The same numbers with top-level rooms only (a sub-package counted in its package): circles there
  cross the layers; a circle between a package and its own sub-package stays inside one layer."""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def modules(root: Path, top: str) -> dict[str, Path]:
    """Module name -> file of every module under `root / top` (a package is its `__init__.py`)."""
    found = {}
    for path in sorted((root / top).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules `name` imports anywhere in its body, inside functions and under `TYPE_CHECKING` too
    (`from a import b` counts a.b when it is a module of `known`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known)
    return out


def room_graph(repo: Path) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(module -> its room, room -> the rooms it imports from)."""
    pkg = repo / "dare_core"
    known = modules(repo, "dare_core")
    # a module of a (sub-)package belongs to it; a top-level module is a room of its own
    rooms = {m: m if p.parent == pkg else ".".join(p.parent.relative_to(repo).parts) for m, p in known.items()}
    arrows: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for name in imports(module, path, known):
            while name and name not in rooms:
                name = name.rpartition(".")[0]
            if name and rooms[name] != rooms[module]:
                arrows[rooms[module]].add(rooms[name])
    return rooms, arrows


def circles(nodes: list[str], arrows: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (rooms or modules), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in arrows.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def floors(nodes: list[str], arrows: dict[str, set[str]], groups: list[list[str]]) -> int:
    rep = {v: v for v in nodes}
    for g in groups:
        for v in g:
            rep[v] = g[0]
    dag: dict[str, set[str]] = defaultdict(set)
    for a, bs in arrows.items():
        dag[rep[a]].update(rep[b] for b in bs if rep[b] != rep[a])
    depth: dict[str, int] = {}

    def d(v: str) -> int:
        if v not in depth:
            depth[v] = 1 + max((d(w) for w in dag.get(v, ())), default=0)
        return depth[v]

    return max(d(rep[v]) for v in nodes)


def walk(repo: Path) -> dict:
    """The RL stage's calls from its start to loading the model, on a tiny project."""
    code = f"""
import json, sys
sys.path.insert(0, {str(repo / 'tests')!r})
from pipeline_helpers import tiny_params, worker_env, write_params
import subprocess, pathlib
root = pathlib.Path(sys.argv[1])
write_params(root / "params.yaml", tiny_params(root))
for stage in ("prepare", "sft"):
    subprocess.run([sys.executable, "-m", "dare_core.cli", "stage", stage], cwd=root, env=worker_env(), check=True,
                   capture_output=True)
"""
    with tempfile.TemporaryDirectory(prefix="dare-walk-") as tmp:
        subprocess.run([sys.executable, "-c", code, tmp], cwd=repo, check=True)
        tracer = f"""
import json, os, sys
os.chdir({tmp!r})
sys.path.insert(0, {str(repo)!r})
from dare_core.config import load_config
try:
    from dare_core.training.rl.loop import run_rl
except ImportError:
    from dare_core.training.rl_loop import run_rl
rooms = json.loads(sys.argv[1])
trail = []
class Loaded(Exception):
    pass
def room(frame):
    name = frame.f_globals.get("__name__", "")
    while name and name not in rooms:
        name = name.rpartition(".")[0]
    return rooms.get(name)
def prof(frame, event, arg):
    if event == "call":
        if frame.f_code.co_name == "load_model" and room(frame) == "dare_core.models":
            raise Loaded
        r = room(frame)
        caller = frame.f_back
        if r is not None:
            trail.append((room(caller) if caller else None, r, caller.f_globals.get("__name__") if caller else None,
                          frame.f_globals.get("__name__")))
sys.setprofile(prof)
try:
    run_rl(load_config("params.yaml"), progress=False)
except Loaded:
    pass
finally:
    sys.setprofile(None)
print(json.dumps(trail))
"""
        rooms, _ = room_graph(repo)
        out = subprocess.run([sys.executable, "-c", tracer, json.dumps(rooms)], cwd=repo, check=True, capture_output=True,
                             text=True, env={**__import__("os").environ, "PYTHONPATH": str(repo)})
        trail = json.loads(out.stdout.strip().splitlines()[-1])
    entered = {r for _, r, _, _ in trail}
    crossings = {(a, b) for a, b, _, _ in trail if a is not None and a != b}
    modules = {m for _, _, _, m in trail}
    module_crossings = {(a, b) for _, _, a, b in trail if a in rooms and a != b}
    return {"rooms entered": len(entered), "crossings": len(crossings), "modules entered": len(modules),
            "module crossings": len(module_crossings)}


def top_level(rooms: dict[str, str], arrows: dict[str, set[str]]) -> tuple[dict[str, str], dict[str, set[str]]]:
    top = lambda r: ".".join(r.split(".")[:2])  # noqa: E731
    merged: dict[str, set[str]] = defaultdict(set)
    for a, bs in arrows.items():
        merged[top(a)].update(top(b) for b in bs if top(b) != top(a))
    return {m: top(r) for m, r in rooms.items()}, merged


def numbers(repo: Path, with_walk: bool) -> dict:
    rooms, arrows = room_graph(repo)
    top_rooms, top_arrows = top_level(rooms, arrows)
    top_nodes = sorted(set(top_rooms.values()))
    top_groups = circles(top_nodes, top_arrows)
    nodes = sorted(set(rooms.values()))
    groups = circles(nodes, arrows)
    lines = sum(len(p.read_text().splitlines()) for p in (repo / "dare_core").rglob("*.py") if "__pycache__" not in p.parts)
    loose = sum(1 for m, r in rooms.items() if m == r and m.count(".") == 1 and (repo / (m.replace(".", "/") + ".py")).is_file())
    out = {"lines": lines, "rooms": len(nodes), "loose top-level modules": loose, "floors": floors(nodes, arrows, groups),
           "arrows": sum(len(v) for v in arrows.values()), "circles": groups,
           "top-level rooms": len(top_nodes), "top-level floors": floors(top_nodes, top_arrows, top_groups),
           "top-level arrows": sum(len(v) for v in top_arrows.values()), "top-level circles": top_groups}
    if with_walk:
        out["rl walk to load"] = walk(repo)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--walk", action="store_true")
    args = ap.parse_args()
    print(json.dumps(numbers(Path(args.repo), args.walk), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
