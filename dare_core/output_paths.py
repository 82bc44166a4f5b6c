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
from typing import TYPE_CHECKING, Optional, Union

from dare_core.storage import is_remote

if TYPE_CHECKING:
    from dare_core.config import DareConfig

# in the project folder: files and folders a run must never replace or write into
PROJECT_FILES = ("dvc.yaml", "dvc.lock", "params.yaml", "prefect.yaml", "pyproject.toml", "Makefile", ".git", ".dvc",
                 ".dvcignore", ".gitignore", "dare_core", "flows", "tasks", "configs", "tests", "scripts", "docker",
                 "docs", "requirements", "bench")


# the folders of the stages in the run folder, each replaced in part or whole by its stage
RUN_STAGES = ("base", "sft", "preference", "rl", "eval")


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


def _location(setting: str, value: Union[str, Path], root: Path, what: str = "", container: bool = False) -> Location:
    text = str(value)
    local = text[len("file://"):] if text.startswith("file://") else text
    return Location(setting, what, text, Path(os.path.realpath(root / os.path.expanduser(local))), container)


def output_locations(cfg: DareConfig, root: Path) -> list[Location]:
    """Every folder a run writes: the run folder and each stage's folder in it, the exported
    model, the metrics files, the prepared data, the tokenizer of a from-scratch model, and a local
    artifact copy."""
    run, data = cfg.run, cfg.data
    run_dir = Path(run.runs_dir) / run.name
    outputs = [
        _location("run.runs_dir", run_dir, root, "run folder", container=True),
        *(_location("run.runs_dir", run_dir / stage, root, f"{stage} folder") for stage in RUN_STAGES),
        _location("run.models_dir", Path(run.models_dir) / run.name, root, "model folder"),
        _location("run.metrics_dir", run.metrics_dir, root),
        _location("data.prepared_dir", data.prepared_dir, root),
    ]
    if not cfg.model.path:  # with a given model its tokenizer is used, and prepare writes none
        outputs.append(_location("data.tokenizer_dir", data.tokenizer_dir, root))
    if run.artifact_root and not is_remote(run.artifact_root):
        outputs.append(_location("run.artifact_root", Path(run.artifact_root) / run.name, root, "copy of the run"))
    return outputs


def input_locations(cfg: DareConfig, root: Path) -> list[Location]:
    """The user's files a run reads (local ones; a URL is fetched into the download cache)."""
    given = {"data.source": cfg.data.source, "data.eval_source": cfg.data.eval_source,
             "data.val_source": cfg.data.val_source, "data.preference_source": cfg.data.preference_source,
             "model.path": cfg.model.path, "eval.data_dir": cfg.eval.data_dir, "launch.hostfile": cfg.launch.hostfile}
    return [_location(key, value, root) for key, value in given.items() if value and not is_remote(value)]


def project_locations(root: Path, params_file: Optional[Path]) -> list[Location]:
    """The project's own files that exist (and the params file wherever it lies), and the dare_core
    package this process runs."""
    found = [_location("the project", name, root) for name in PROJECT_FILES if (root / name).exists()]
    if params_file is not None:
        found.append(_location("the params file", params_file, root))
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


def output_conflict(cfg: DareConfig, root: Union[str, Path, None] = None,
                    params_file: Union[str, Path, None] = None) -> Optional[str]:
    """The first output location that collides with another location (module docstring), as a
    message naming both settings and the paths; None when there is none. `root`: the folder relative
    paths start from (the working directory of the stages; default: the current one)."""
    root = Path(os.path.realpath(root if root is not None else os.getcwd()))
    outputs = output_locations(cfg, root)
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
        for given in input_locations(cfg, root):
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
