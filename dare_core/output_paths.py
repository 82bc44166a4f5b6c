"""Where a run writes, checked as one set when its config is loaded, before any stage runs.

A stage replaces its output folders whole (storage.atomic_dirs), so an output that is, holds or sits
in another location would delete it: `run.models_dir: runs` makes the exported model folder
runs/<name>, the run folder with every checkpoint; `data.tokenizer_dir` equal to `data.prepared_dir`
makes the tokenizer replace the prepared splits. No output location (in the run folder: each
stage's folder; other outputs may sit beside them) may be the same as, contain or lie inside another
output, an input (the dataset files, `model.path`, `eval.data_dir`,
`launch.hostfile`) or the project's own files (dvc.yaml, the params file, code folders); nor may it
be or contain the project folder itself. `load_config` runs this for every caller: `dare stage`, each
rank's worker, the Prefect flow (before `dvc repro` removes a stage's outputs) and `dare eval`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

# in the project folder: files and folders a run must never replace or write into
PROJECT_FILES = ("dvc.yaml", "dvc.lock", "params.yaml", "prefect.yaml", "pyproject.toml", "Makefile", ".git", ".dvc",
                 ".dvcignore", ".gitignore", "dare_core", "flows", "tasks", "configs", "tests", "scripts", "docker",
                 "docs", "requirements", "bench")


# the folders of the stages in the run folder, each replaced in part or whole by its stage
RUN_STAGES = ("base", "sft", "preference", "rl", "eval")


@dataclass(frozen=True)
class Place:
    """A location as the config names it (`DareConfig.output_places`, `input_places`): which setting
    places it, its value, and for a derived folder what lies there; resolved against the project
    folder by `output_conflict`. The config knows its settings; this module only how they collide."""

    setting: str
    value: Union[str, Path]
    what: str = ""
    container: bool = False


@dataclass(frozen=True)
class Location:
    setting: str  # the key that places it, e.g. run.models_dir
    what: str  # "" where the setting's value is the location itself, else what lies there
    shown: str  # the path as the config spells it
    path: Path  # absolute, symlinks resolved
    # the run folder holds the stages' folders, which are outputs of their own: what lies beside
    # them (bench runs keep run.metrics_dir there) is never replaced
    container: bool = False

    def describe(self) -> str:
        return f"{self.setting} ({self.shown})" if not self.what else f"{self.setting}'s {self.what} {self.shown}"


def _location(place: Place, root: Path) -> Location:
    text = str(place.value)
    local = text[len("file://"):] if text.startswith("file://") else text
    return Location(place.setting, place.what, text, Path(os.path.realpath(root / os.path.expanduser(local))), place.container)


def project_locations(root: Path, params_file: Optional[Path]) -> list[Location]:
    """The project's own files that exist (and the params file wherever it lies), and the dare_core
    package this process runs."""
    found = [_location(Place("the project", name), root) for name in PROJECT_FILES if (root / name).exists()]
    if params_file is not None:
        found.append(_location(Place("the params file", params_file), root))
    package = Path(__file__).resolve().parent
    found.append(Location("the dare_core package", "", str(package), package))
    return found


def _relation(a: Location, b: Location) -> Optional[str]:
    if a.path == b.path:
        return "is the same as"
    if b.path.is_relative_to(a.path):
        return None if a.container else "contains"
    if a.path.is_relative_to(b.path):
        return None if b.container else "is inside"
    return None


def _describe_project(loc: Location) -> str:
    if loc.setting == "the project":
        return f"the project's {loc.shown}"
    if loc.setting == "the params file":
        return f"the params file {loc.shown}"
    return f"the dare_core package {loc.shown}"


def output_conflict(output_places: list[Place], input_places: list[Place], root: Union[str, Path, None] = None,
                    params_file: Union[str, Path, None] = None) -> Optional[str]:
    """The first output location that collides with another location (module docstring), as a
    message naming both settings and the paths; None when there is none. `root`: the folder relative
    paths start from (the working directory of the stages; default: the current one)."""
    root = Path(os.path.realpath(root if root is not None else os.getcwd()))
    outputs = [_location(place, root) for place in output_places]
    inputs = [_location(place, root) for place in input_places]
    fix = "give each output a folder of its own"
    for out in outputs:
        if out.path == root or root.is_relative_to(out.path):
            relation = "is the same as" if out.path == root else "contains"
            return (f"{out.describe()} {relation} the project folder {root}: a stage replacing it would delete the "
                    f"project; {fix} inside it")
    for i, out in enumerate(outputs):
        for other in outputs[i + 1:]:
            relation = _relation(out, other)
            if relation:
                return f"{out.describe()} {relation} {other.describe()}: a stage replacing one would delete the other; {fix}"
        for given in inputs:
            relation = _relation(out, given)
            if relation:
                return (f"{out.describe()} {relation} the input {given.describe()}: a stage would overwrite the "
                        f"user's files or write among them; {fix}, apart from the inputs")
        for own in project_locations(root, Path(params_file) if params_file is not None else None):
            relation = _relation(out, own)
            if relation:
                return (f"{out.describe()} {relation} {_describe_project(own)}: a stage would overwrite the "
                        f"project's own files; {fix} (the defaults are runs, models, metrics, data/prepared, "
                        f"data/tokenizer)")
    return None
