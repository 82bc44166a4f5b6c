"""The content of the user's input files, recorded so that DVC sees an edit.

`data.source` and the other input files are settings, so dvc.yaml cannot name them as `deps` (a
null setting would break it), and a path that stays the same hides an edited file from DVC. The
`inputs` stage, which DVC runs on every `dvc repro` (`always_changed`), writes the identity of
each input to `<run.metrics_dir>/inputs.json`: a local file's SHA-256, an object's size and ETag in
object storage, and the source file of a user reward (`rl.reward: module:function`). The stages that
read these inputs (prepare, rl, eval) depend on that file: DVC reruns them, and what follows them,
exactly when an input's content changed. The module of a user reward is found on disk, never
imported (importing runs the user's code).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

from dare_core.config import DareConfig
from dare_core.errors import UserError
from dare_core.remote import file_digest, listing, local_copy
from dare_core.storage import is_remote

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


def file_identity(setting: str, value: Optional[str]) -> Optional[dict]:
    """What identifies the content at `value` (None when the setting is empty)."""
    if not value:
        return None
    if is_remote(value):
        return {"url": value, "objects": listing(value, setting)}
    path = Path(os.path.expanduser(value[len("file://"):] if value.startswith("file://") else value))
    if not path.is_file():
        raise UserError(f"{setting}: {value} is not a file")
    return {"path": value, "sha256": file_digest(path, "sha256")}


def module_source(module: str, search: list[str]) -> Optional[Path]:
    """The file that `import module` would load from the folders `search`, found without importing."""
    parts = module.split(".")
    for folder in search:
        base = Path(folder or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def reward_identity(reward: str) -> Optional[dict]:
    """A user reward's module file and its SHA-256; None for a built-in reward (its code is DARE's,
    which dvc.yaml tracks) or a module that is not a plain file (compiled, zipped)."""
    if ":" not in reward:
        return None
    module = reward.split(":", 1)[0]
    # the stages run in the repository root, which the reward loader puts first on sys.path
    found = module_source(module, [os.getcwd(), *sys.path[1:]])
    if found is None:
        return {"module": module, "file": None}
    return {"module": module, "file": str(found), "sha256": file_digest(found, "sha256")}


def identities(cfg: DareConfig) -> dict[str, Any]:
    """{setting: identity} of every input a stage reads (module docstring)."""
    out: dict[str, Any] = {key: file_identity(key, getattr(cfg.data, key.split(".")[1])) for key in FILES}
    out["rl.reward"] = reward_identity(cfg.rl.reward)
    return out
