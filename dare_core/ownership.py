"""Which folders a stage may replace: only those DARE wrote.

A stage writes each of its output folders whole (storage.atomic_dirs: a new folder renamed over
the old one, which is then deleted), and it writes `OUTPUT_MARKER` into every folder it writes that
way. An existing folder is replaced only when
- it holds the marker (DARE wrote it), or
- it is empty, or
- it holds only files the stage writes there itself (`writes`: patterns of relative paths): a folder
  an earlier DARE version wrote before the marker existed, adopted, and marked from then on.
Anything else (a dataset, a README, a model of the user's own, someone's notes) means the folder is
not the stage's to delete: the stage stops with one line that names the folder and a file in it.
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Iterable, Optional, Union

from dare_core.errors import UserError

OUTPUT_MARKER = ".dare-output"
MARKER_TEXT = ("This folder was written by DARE: a stage replaces it whole when it runs again.\n"
               "Without this file a stage refuses to replace the folder unless it is empty.\n")

# left instead of weights in the model folder of a stage that was switched off, holding why
# (training/preference_off.py)
STAGE_OFF_NOTE = "STAGE_OFF.txt"


def leave_stage_off_note(folder: Union[str, Path], why: str) -> None:
    """Say in `folder` (made if missing) why it holds nothing else: DVC warns at every `dvc repro`
    about an empty output folder, and a reader of the folder learns why it is empty."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / STAGE_OFF_NOTE).write_text(why + "\n")


def stage_off_note(folder: Union[str, Path]) -> Optional[str]:
    """The text an off stage left in its model folder, or None."""
    note = Path(folder) / STAGE_OFF_NOTE
    return note.read_text().strip() if note.is_file() else None


def mark(folder: Union[str, Path]) -> None:
    """Record that DARE wrote `folder` (a stage's own new folder, before it is renamed into place)."""
    (Path(folder) / OUTPUT_MARKER).write_text(MARKER_TEXT)


def files_under(folder: Union[str, Path]) -> list[str]:
    """Relative paths of everything but folders under `folder` (links not followed), the marker left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        rel = os.path.relpath(dirpath, folder)
        # a link to a folder is an entry of its own: replacing would delete the link, not what it points to
        found += [os.path.normpath(os.path.join(rel, d)) for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        found += [os.path.normpath(os.path.join(rel, f)) for f in filenames]
    return sorted(f.replace(os.sep, "/") for f in found if f != OUTPUT_MARKER)


def foreign_files(folder: Union[str, Path], writes: Iterable[str] = ()) -> list[str]:
    """The files of the existing folder `folder` that replacing it would delete though no DARE
    stage wrote them: none where it holds the marker, else those matching no pattern in `writes`."""
    if (Path(folder) / OUTPUT_MARKER).is_file():
        return []
    patterns = list(writes)
    return [f for f in files_under(folder) if not any(fnmatch.fnmatchcase(f, p) for p in patterns)]


def check_replaceable(path: Union[str, Path], writes: Iterable[str] = ()) -> None:
    """Raise UserError unless a stage may replace `path` whole (the module docstring's rule); a
    missing `path` may always be written."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a folder DARE wrote: a stage replaces this output folder whole, so it "
                        f"will not; move the file away or set the output elsewhere")
    foreign = foreign_files(path, writes)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"{path} holds files DARE did not write ({shown}) and no {OUTPUT_MARKER} marker: a stage "
                        f"replaces this output folder whole, so it will not; move them away or set the output "
                        f"elsewhere")
