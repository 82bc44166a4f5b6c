"""DARE's runtime environment, in one file: `dare.env` at the project's root.

The Makefile includes it (every target exports its variables), and `dare stage`, the Prefect flow
and its stage tasks read it here, filling in what the environment lacks (a value set there wins).
So a deployment's worker, started without make, still builds DeepSpeed's ops once into the
project's `.cache/torch_extensions` and keeps Hugging Face offline.

The format is what both GNU make and this reader take: `KEY=value` lines, `#` comment lines, no
quotes, no inline comments, and one expansion, `${DARE_PROJECT}`: the project's checkout (the
folder of the file; for a workspace of an isolated run, `<checkout>/.cache/workspaces/<name>`, the
checkout it belongs to, so that all runs share one build of the ops). `DARE_PROJECT` is not read
from the environment.

`DS_ACCELERATOR=cpu` depends on the machine, not the project: both add it where there is no
`nvidia-smi` (DeepSpeed would otherwise guess, with a warning, in every process).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import MutableMapping, Optional

from dare_core.errors import UserError

ENV_FILE = "dare.env"
PROJECT = "${DARE_PROJECT}"
_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)")
_CODE_CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout this dare_core runs from


def project_of(folder: Path) -> Path:
    """`folder`, or the checkout whose isolated-run workspace it is."""
    folder = folder.resolve()
    if folder.parent.name == "workspaces" and folder.parent.parent.name == ".cache":
        return folder.parents[2]
    return folder


# what a project's root folder holds: DVC runs every stage's command there (dvc.yaml's folder), so
# the relative paths in the settings (runs, data/prepared, data.source) start there
PROJECT_MARKERS = ("dvc.yaml", "params.yaml")


def project_root(start: Optional[Path] = None) -> Path:
    """The project `start` (default: the current folder) belongs to: itself where it holds dvc.yaml or
    params.yaml, else the nearest folder above it that does (`start` is a subfolder of the project),
    else `start` (no project around it: the settings file is named by path)."""
    start = (Path.cwd() if start is None else Path(start)).resolve()
    for folder in (start, *start.parents):
        if any((folder / marker).is_file() for marker in PROJECT_MARKERS):
            return folder
    return start


def enter_project_root(paths: list[Optional[str]]) -> tuple[Optional[Path], list[Optional[str]]]:
    """Change to the project root where the current folder lies below it; `paths` (relative to where
    a command was typed) rebased to it. Returns the root (None: already there) and the paths."""
    here = Path.cwd().resolve()
    root = project_root(here)
    if root == here:
        return None, paths
    rebased = [None if path is None else os.path.relpath(here / path, root) for path in paths]
    os.chdir(root)
    return root, rebased


def read_env_file(path: Path) -> dict[str, str]:
    """The variables of an env file, `${DARE_PROJECT}` expanded (see the module docstring)."""
    project = str(project_of(path.parent))
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.fullmatch(line)
        value = m.group(2).replace(PROJECT, "") if m else ""
        if m is None or "$" in value or "#" in value or value.startswith(("'", '"')):
            raise UserError(f"{path}:{number}: expected KEY=value (no quotes or comments after it; the only "
                            f"expansion is {PROJECT}), got {raw.strip()!r}")
        values[m.group(1)] = m.group(2).replace(PROJECT, project)
    return values


def find_env_file(start: Optional[Path] = None) -> Optional[Path]:
    """`dare.env` of the project at `start` (default: the current folder), else of the checkout this
    code runs from (a project made elsewhere, e.g. a test's); None where neither has one."""
    for folder in (Path.cwd() if start is None else Path(start), _CODE_CHECKOUT):
        if (folder / ENV_FILE).is_file():
            return folder / ENV_FILE
    return None


def env_defaults(start: Optional[Path] = None) -> dict[str, str]:
    """The variables `dare.env` sets (see find_env_file), and DS_ACCELERATOR=cpu without nvidia-smi."""
    path = find_env_file(start)
    values = read_env_file(path) if path is not None else {}
    if shutil.which("nvidia-smi") is None:
        values.setdefault("DS_ACCELERATOR", "cpu")
    return values


def apply_env_defaults(environ: MutableMapping[str, str], start: Optional[Path] = None,
                       skip: tuple[str, ...] = ()) -> MutableMapping[str, str]:
    """Fill in `environ` (os.environ, or a child's copy) from env_defaults, never over a value set;
    `skip`: variables the caller decides on itself. Returns `environ`."""
    for key, value in env_defaults(start).items():
        if key not in skip:
            environ.setdefault(key, value)
    return environ
