"""What a training stage checks before it writes anything: that its output folders can be written
and that the disk has room for what it will write there (the checkpoints its save policy writes and
the exported model), estimated from the parameter count of the model it will train. A stage runs
these after its config and input checks and before DeepSpeed starts, so a full or read-only disk
fails in a second with one line, not after an hour of training with a half-written checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from dare_core.models.hf_folder import EXPORT_FILES
from dare_core.ownership import check_replaceable
from dare_core.storage import check_free_space, check_writable

# Adam's two moments per trainable parameter, in fp32
ADAM_BYTES = 8
# the fp32 master copy DeepSpeed keeps of each trainable 16-bit parameter
MASTER_BYTES = 4


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters; works on a model on the meta device (no memory)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def model_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The exported weights of `model` in `dtype`; also about the size of a weights-only checkpoint."""
    return parameter_counts(model)[0] * dtype.itemsize


def checkpoint_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """About the size of one DeepSpeed checkpoint: every weight in the training dtype, plus Adam's
    moments (and, below 32 bits, the fp32 master weights) of the trainable ones (LoRA: the adapter)."""
    total, trainable = parameter_counts(model)
    per_trainable = ADAM_BYTES + (MASTER_BYTES if dtype.itemsize < 4 else 0)
    return total * dtype.itemsize + trainable * per_trainable


def checkpoints_need(saves: list[int], existing: list[int], keep_last: int) -> tuple[int, int]:
    """Bytes a run's checkpoints add to the disk: (at the peak, at the end). `saves`: the size of
    each checkpoint it writes, in order; `existing`: those already in the folder, oldest first.
    CheckpointManager.save writes each whole beside the kept ones and only then deletes all but the
    last `keep_last`, so keep_last + 1 coexist while one is written."""
    before = sum(existing)
    on_disk, peak = list(existing), 0
    for size in saves:
        peak = max(peak, sum(on_disk) + size - before)
        on_disk = (on_disk + [size])[-keep_last:]
    return peak, sum(on_disk) - before


def training_need(saves: list[int], existing: list[int], keep_last: int, export_bytes: int) -> int:
    """What a training stage adds to the disk of its folder at the peak: its checkpoints
    (`checkpoints_need`), then, beside those it keeps, the exported model (`export_bytes`; 0: none)."""
    peak, kept = checkpoints_need(saves, existing, keep_last)
    return max(peak, kept + export_bytes)


def stage_writes(out_dir: Path) -> list[Path]:
    """What a training stage writes in its folder: the folder, its checkpoints, and the files it
    rewrites there (metrics.jsonl, the plot CSVs, ...)."""
    paths = [out_dir, out_dir / "checkpoints"]
    if out_dir.is_dir():
        paths += sorted(p for p in out_dir.iterdir() if p.is_file())
    return paths


def check_outputs(writes: Iterable[Path], needs: list[tuple[Path, int]], what: str,
                  exports: Iterable[Path] = ()) -> None:
    """Raise UserError, naming the folder, unless every path in `writes` can be written, each
    model folder in `exports` is DARE's to replace (ownership.py) and the disk holds `needs`
    ((where, bytes); `what` says what they are)."""
    for path in writes:
        check_writable(path)
    for folder in exports:
        check_replaceable(folder, EXPORT_FILES)
    check_free_space(needs, what)
