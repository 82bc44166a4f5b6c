"""What `dare eval` calls each checkpoint in its table: the pipeline stage that wrote it, else its
folder's name, unless `--name` says otherwise.

Stage outputs have generic folder names (`runs/<run>/sft/model`, `models/<run>`), so a table
headed by folder names reads `model | model_ | embedded`; the eval stage's own names (base, sft,
preference, rl) say what each column is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from dare_core.config import DareConfig
from dare_core.errors import UserError

TRAINED_STAGES = ("sft", "preference")  # runs/<run>/<stage>/model


def _resolved(path: Path | str) -> Path:
    return Path(path).expanduser().resolve()


def stage_of(folder: Path | str, cfg: DareConfig) -> Optional[str]:
    """The stage whose output `folder` is, by the layout of `cfg` (runs_dir, models_dir): this
    run's checkpoints as the eval stage names them, and the same places of the project's other
    runs; None for any other folder."""
    from dare_core.workers.eval import checkpoints

    path = _resolved(folder)
    for stage, where in checkpoints(cfg).items():
        if _resolved(where) == path:
            return stage
    runs, models = _resolved(cfg.run.runs_dir), _resolved(cfg.run.models_dir)
    if path.name == "base" and path.parent.parent == runs:
        return "base"
    if path.name == "model" and path.parent.name in TRAINED_STAGES and path.parent.parent.parent == runs:
        return path.parent.name
    # a folder under models/ is only the converted RL model when its run trained one (models/ also
    # holds downloaded models)
    if path.parent == models and (runs / path.name / "rl").is_dir():
        return "rl"
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
