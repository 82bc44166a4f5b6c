"""What `dare eval` calls each checkpoint in its table: the pipeline stage that wrote it, else its
folder's name, unless `--name` says otherwise.

Stage outputs have generic folder names (`runs/<run>/sft/model`, `models/<run>`), so a table
headed by folder names reads `model | model_ | embedded`; the eval stage's own names (base, sft,
preference, rl) say what each column is.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

from dare_core.config import DareConfig
from dare_core.errors import UserError

def _resolved(path: Path | str) -> Path:
    return Path(path).expanduser().resolve()


def stage_of(folder: Path | str, cfg: DareConfig) -> Optional[str]:
    """The stage whose output `folder` is, by the layout of `cfg` (runs_dir, models_dir): this
    run's checkpoints as the eval stage names them, and the same places of the project's other
    runs (named by the folder's path); None for any other folder."""
    path = _resolved(folder)
    # runs/<run>/base, runs/<run>/<stage>/model, models/<run>: the run is one of the path's last names
    candidates = dict.fromkeys([cfg.run.name, path.name, path.parent.name, path.parent.parent.name])
    for run in candidates:
        other = run != cfg.run.name
        # another run's base is its untrained model, whatever this run starts from
        run_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=run),
                                      model=dataclasses.replace(cfg.model, path=None) if other else cfg.model)
        for stage, where in run_cfg.checkpoint_dirs.items():
            # models/ also holds downloaded models: another run's folder there is its RL model only
            # if that run trained one
            if _resolved(where) == path and not (other and stage == "rl" and not run_cfg.stage_dir("rl").is_dir()):
                return stage
    return None


def _check_name(name: str) -> str:
    # the label names OpenCompass's result folders and a column of the markdown table
    if not name.strip() or name.strip() in (".", "..") or any(c in name for c in "/\\|"):
        raise UserError(f"--name {name!r}: give a non-empty label without '/', '\\' or '|'")
    return name.strip()


def checkpoint_labels(folders: Sequence[str], names: Optional[Sequence[str]], cfg: DareConfig) -> dict[str, Path]:
    """{label: folder} in the order given: `names` (one per folder) where given, else each folder's
    stage (`stage_of`), else its folder name. Two folders with one label are an error naming both."""
    if names and len(names) != len(folders):
        raise UserError(f"--name given {len(names)} time(s) for {len(folders)} --model folder(s); "
                        "give one --name per --model, in the same order")
    labels: dict[str, Path] = {}
    for i, folder in enumerate(folders):
        if names:
            label = _check_name(names[i])
        else:
            label = stage_of(folder, cfg) or _resolved(folder).name or "model"
        if label in labels:
            raise UserError(f"--model {labels[label]} and --model {folder} would both be labelled '{label}'; "
                            "tell them apart with one --name per --model")
        labels[label] = Path(folder)
    return labels
