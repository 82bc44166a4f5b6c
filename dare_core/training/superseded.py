"""Checkpoints a training stage set aside: `<stage>/superseded/NNNN/`, one folder per set, numbered in
the order they were set aside (newest last), each with `set_aside.json` (when, why, and the settings
of its last checkpoint) and `logs/`, a copy of what the run logged beside its checkpoints (metrics,
validation rows, their CSVs and plots, TensorBoard's events), which a fresh run rewrites. Nothing
here deletes a set: the user prunes the folder. A run whose settings
and inputs match a set's last checkpoint (a change reverted, after any number of others) resumes
from it: `CheckpointManager.check` finds it with `find_matching`, `begin` moves it back.

Older DARE kept one set directly in `superseded/` (`latest`, `step*`); it is read as the oldest set
and moved into a numbered folder of its own the next time a set is added."""
from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from dare_core.artifacts import CHECKPOINT_MARKER as META_NAME
from dare_core.storage import atomic_write_json

SET_INFO = "set_aside.json"
LOGS = "logs"
# folders of a stage's output that are not its run's logs
NOT_LOGS = frozenset({"checkpoints", "superseded", "model"})


def _copy_logs(stage_dir: Path, dest: Path) -> None:
    """What the run logged in `stage_dir` (its files, and folders such as tensorboard/), into `dest`."""
    for entry in stage_dir.iterdir() if stage_dir.is_dir() else ():
        if entry.name in NOT_LOGS or entry.name.startswith("."):
            continue
        dest.mkdir(parents=True, exist_ok=True)
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, dirs_exist_ok=True)
        elif entry.is_file():
            shutil.copy2(entry, dest / entry.name)


def _numbered(root: Path) -> list[Path]:
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)) \
        if root.is_dir() else []


def _legacy(root: Path) -> bool:
    return (root / "latest").is_file()


def sets(root: Path) -> list[Path]:
    """The sets under `root`, oldest first (a legacy set at the root itself first)."""
    return ([root] if _legacy(root) else []) + _numbered(root)


def latest_meta(folder: Path) -> Optional[tuple[str, dict]]:
    """(tag, DARE metadata) of the checkpoint `latest` names in `folder`; None where it is missing or
    unreadable (a set that cannot be resumed is simply not a match)."""
    try:
        tag = (folder / "latest").read_text().strip()
        meta = json.loads((folder / tag / META_NAME).read_text())
    except (OSError, ValueError):
        return None
    return (tag, meta) if isinstance(meta, dict) else None


def find_matching(root: Path, accepts: Callable[[dict], bool]) -> Optional[tuple[Path, str, dict]]:
    """The newest set whose last checkpoint `accepts` (its metadata): (set folder, tag, metadata)."""
    for folder in reversed(sets(root)):
        found = latest_meta(folder)
        if found is not None and accepts(found[1]):
            return folder, found[0], found[1]
    return None


def migrate_legacy(root: Path) -> Optional[Path]:
    """Move a set kept by an older DARE at the root of `root` into a numbered folder of its own
    (after the numbered ones); returns that folder, or None where there is no such set."""
    if not _legacy(root):
        return None
    numbers = [int(p.name) for p in _numbered(root)]
    dest = root / f"{(max(numbers) if numbers else 0) + 1:04d}"
    dest.mkdir()
    for entry in list(root.iterdir()):
        if entry != dest and not (entry.is_dir() and entry.name.isdigit()):
            os.replace(entry, dest / entry.name)
    _write_info(dest, "set aside by an older DARE")
    return dest


def _write_info(folder: Path, why: str) -> None:
    found = latest_meta(folder)
    atomic_write_json(folder / SET_INFO, {
        "set_aside_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "why": why, "latest": found[0] if found else None,
        "settings": found[1].get("settings") if found else None, "inputs": found[1].get("inputs") if found else None})


def keep(ckpt_dir: Path, root: Path, why: str) -> Path:
    """Move the folder `ckpt_dir` into `root` as its newest set (a rename: no space, no time) and
    leave an empty `ckpt_dir`; returns the set's folder."""
    root.mkdir(parents=True, exist_ok=True)
    migrate_legacy(root)
    numbers = [int(p.name) for p in _numbered(root)]
    dest = root / f"{(max(numbers) if numbers else 0) + 1:04d}"
    os.replace(ckpt_dir, dest)
    ckpt_dir.mkdir(parents=True)
    _copy_logs(ckpt_dir.parent, dest / LOGS)
    _write_info(dest, why)
    return dest


def restore(folder: Path, ckpt_dir: Path) -> None:
    """Move a numbered set back to be the stage's checkpoints (`ckpt_dir`: absent or empty), and its
    logs back beside them (the resumed run continues them)."""
    (folder / SET_INFO).unlink(missing_ok=True)
    if (folder / LOGS).is_dir():
        _copy_logs(folder / LOGS, ckpt_dir.parent)
        shutil.rmtree(folder / LOGS)
    if ckpt_dir.is_dir():
        ckpt_dir.rmdir()  # empty: what `keep` left, or a fresh folder
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(folder, ckpt_dir)
