"""The content of the user's input files, recorded so that DVC sees an edit.

`data.source` and the other input files are settings, so dvc.yaml cannot name them as `deps` (a
null setting would break it), and a path that stays the same hides an edited file from DVC. Two
records make up for it. `data/input_files.yaml` lists the files inside the project that the
settings name (data files, a user reward's sources); dvc.yaml reads it (`vars`) and makes one
`input_file@<path>` stage depend on each, so `dvc status` names an edited file before anything
runs (a file in object storage is seen only when a stage reads it). The
`inputs` stage, which DVC runs on every `dvc repro` (`always_changed`), writes the identity of
each input to `<run.metrics_dir>/inputs.json`: a local file's SHA-256, an object's size and ETag in
object storage, and the source file of a user reward (`rl.reward: module:function`). The stages that
read these inputs (prepare, rl, eval) depend on that file: DVC reruns them, and what follows them,
exactly when an input's content changed. The module of a user reward, and the project's modules it
imports, are found on disk by reading their sources, never imported (importing runs the user's code).
Paths under the project (the stages' working directory) are recorded relative to it, so that the
record, which users commit, reads the same in every clone.
"""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any, Optional

from dare_core.config import DareConfig
from dare_core.errors import UserError
from dare_core.object_cache import local_copy
from dare_core.remote import file_digest, listing
from dare_core.storage import atomic_write_text, is_remote

FILES = ("data.source", "data.eval_source", "data.val_source", "data.preference_source")


def model_folder(cfg: DareConfig) -> Optional[Path]:
    """`model.path` as a local folder: itself, or for a URL its verified copy in the download
    cache, fetched (or refreshed) here; None for a from-scratch model."""
    if not cfg.model.path:
        return None
    return local_copy(cfg.model.path, "model folder", folder=True)


def tokenizer_folder(cfg: DareConfig) -> Path:
    """Where a stage's tokenizer is: the given model's folder, else the one the prepare stage wrote."""
    return model_folder(cfg) or Path(cfg.data.tokenizer_dir)


def inputs_file(cfg: DareConfig) -> Path:
    return Path(cfg.run.metrics_dir) / "inputs.json"


# written by the inputs stage, read by dvc.yaml's `vars` (module docstring); a fresh project ships it empty
INPUT_FILES_LIST = Path("data") / "input_files.yaml"
INPUT_FILES_HEADER = ("# Written by `dare stage inputs` (commit it): the files in this project that params.yaml names as\n"
                      "# inputs. dvc.yaml makes an `input_file@<path>` stage depend on each, so `dvc status` sees an edit.\n")


def local_path(value: str) -> Path:
    return Path(os.path.expanduser(value[len("file://"):] if value.startswith("file://") else value))


def file_identity(setting: str, value: Optional[str]) -> Optional[dict]:
    """What identifies the content at `value` (None when the setting is empty)."""
    if not value:
        return None
    if is_remote(value):
        return {"url": value, "objects": listing(value, setting)}
    path = local_path(value)
    if not path.is_file():
        raise UserError(f"{setting}: {value} is not a file")
    return {"path": project_path(path), "sha256": file_digest(path, "sha256")}


def module_source(module: str, search: list[str]) -> Optional[Path]:
    """The file that `import module` would load from the folders `search`, found without importing."""
    parts = module.split(".")
    for folder in search:
        base = Path(folder or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def project_path(path: Path) -> str:
    """`path` relative to the project (the working directory) where it lies inside it, else as given."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


# DARE's own code is tracked by dvc.yaml; a user module importing it does not make it the user's input
OWN_PACKAGES = ("dare_core",)
# a reward module importing more of the project than this is read only this far (each file is hashed)
MAX_SOURCES = 500


def _imported_names(source: Path, module: str) -> list[str]:
    """The absolute names of the modules `source` (the file of `module`) imports; for `from a import
    b`, both `a.b` (b may be a submodule) and `a`. A file that does not parse imports nothing here:
    importing it fails, with the real error, when the reward loads."""
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except (SyntaxError, ValueError):
        return []
    package = module if source.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, `level - 1` packages up
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base:
                names.append(base)
            names += [f"{base}.{alias.name}" if base else alias.name for alias in node.names if alias.name != "*"]
    return names


def project_sources(module: str, root: Path) -> dict[str, Path]:
    """The files of `module` and of every module it imports, transitively, that lie under `root` (the
    user's project), found by reading their sources (never by importing them); the module's own
    file first, by module name. A package's `__init__.py` is included wherever a module under it is
    (importing runs it)."""
    root = root.resolve()
    found: dict[str, Path] = {}
    queue = [module]
    while queue and len(found) < MAX_SOURCES:
        name = queue.pop(0)
        if name in found or name.split(".")[0] in OWN_PACKAGES:
            continue
        path = module_source(name, [str(root)])
        if path is None:
            continue
        found[name] = path
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        queue += parents + _imported_names(path, name)
    return found


def reward_identity(reward: str) -> Optional[dict]:
    """A user reward's module file and its SHA-256, and those of the project's modules it imports
    (`imports`); None for a built-in reward (its code is DARE's, which dvc.yaml tracks). `file` is
    None for a module that is not a plain file (compiled, zipped) or not found."""
    if ":" not in reward:
        return None
    module = reward.split(":", 1)[0]
    # the stages run in the repository root, which the reward loader puts first on sys.path
    found = module_source(module, [os.getcwd(), *sys.path[1:]])
    if found is None:
        return {"module": module, "file": None}
    out = {"module": module, "file": project_path(found), "sha256": file_digest(found, "sha256")}
    imports = [p for p in project_sources(module, Path.cwd()).values() if p.resolve() != found.resolve()]
    if imports:
        out["imports"] = {project_path(p): file_digest(p, "sha256") for p in imports}
    return out


def reward_inputs(reward: str) -> dict[str, Path]:
    """{role: file} of a user reward's sources in the project (its module and what it imports from
    the project), for the fingerprint of a stage that scores with it: an edit to any of them makes
    the stage's checkpoints another run's. Empty for a built-in reward."""
    if ":" not in reward:
        return {}
    module = reward.split(":", 1)[0]
    return {f"reward module {name}": Path(project_path(p)) for name, p in project_sources(module, Path.cwd()).items()}


def identities(cfg: DareConfig) -> dict[str, Any]:
    """{setting: identity} of every input a stage reads (module docstring)."""
    out: dict[str, Any] = {key: file_identity(key, getattr(cfg.data, key.split(".")[1])) for key in FILES}
    out["rl.reward"] = reward_identity(cfg.rl.reward)
    return out


def project_input_files(cfg: DareConfig) -> list[str]:
    """The files under the project (relative paths) that the settings name as inputs: local data
    files and a user reward's sources. Files elsewhere are in inputs.json only."""
    found = [local_path(value) for value in (getattr(cfg.data, key.split(".")[1]) for key in FILES)
             if value and not is_remote(value)]
    found += list(reward_inputs(cfg.rl.reward).values())
    relative = {project_path(p) for p in found if p.is_file()}
    return sorted(p for p in relative if not Path(p).is_absolute())


def write_input_files_list(files: list[str], path: Path = INPUT_FILES_LIST) -> bool:
    """Write the list dvc.yaml reads, only where it changed (an unchanged file keeps git and DVC quiet).
    Returns whether it was written."""
    import yaml

    text = INPUT_FILES_HEADER + yaml.safe_dump({"input_files": files}, default_flow_style=False, sort_keys=False)
    if path.is_file() and path.read_text() == text:
        return False
    atomic_write_text(path, text)
    return True
