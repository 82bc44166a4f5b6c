"""What a stage's checkpoints belong to: the settings that shape its trained weights and the contents
of its inputs. A checkpoint stores its fingerprint whole, so a run with other settings or inputs is
refused with what changed named (training/checkpoint.py), never resumed silently."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dare_core.config import DareConfig, to_dict
from dare_core.training.engine import planned_world_size


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"sft": {"optim": {"lr": 1}}} -> {"sft.optim.lr": 1}: a changed value is named by its key."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


@dataclass
class Fingerprint:
    """What a stage's checkpoints belong to: the settings that shape the trained weights (dotted
    keys; each stage leaves out what does not, e.g. log_every) and the contents of its inputs
    (role -> {path, hash}). Stored whole in every checkpoint, so a mismatch can name what changed."""

    settings: dict
    inputs: dict

    @classmethod
    def of(cls, settings: dict, inputs: dict[str, Path]) -> "Fingerprint":
        # through JSON, so that the values compare equal to the stored ones (tuples become lists)
        flat = json.loads(json.dumps(flatten(settings), default=str))
        return cls(flat, {role: {"path": str(path), "hash": input_fingerprint(path)} for role, path in inputs.items()})

    @property
    def digest(self) -> str:
        blob = json.dumps({"settings": self.settings, "inputs": self.inputs}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def changes(self, meta: dict) -> list[str]:
        """What differs from the fingerprint stored in a checkpoint's `meta`, one phrase each."""
        old, new = meta.get("settings", {}), self.settings
        out = [f"{key}: {_show(old, key)} -> {_show(new, key)}" for key in sorted(set(old) | set(new))
               if old.get(key, _ABSENT) != new.get(key, _ABSENT)]
        stored_inputs = meta.get("inputs", {})
        for role, now in self.inputs.items():
            before = stored_inputs.get(role)
            if before is None or before.get("path") != now["path"]:
                out.append(f"{role}: {before.get('path') if before else '(none)'} -> {now['path']}")
            elif before.get("hash") != now["hash"]:
                out.append(f"the {role} {now['path']} changed")
        return out


_ABSENT = object()


def _show(settings: dict, key: str) -> str:
    value = settings.get(key, _ABSENT)
    return "(not set)" if value is _ABSENT else json.dumps(value)


# Settings that never change the trained weights, left out of every stage's fingerprint so that
# changing them resumes the run: when metrics are logged, when checkpoints are written (a resumed run
# reproduces the weights of an uninterrupted one whatever the interval) and how many are kept.
# Everything else stays in, memory knobs included (rows_per_forward, sampler.batch_size): they split
# sums differently, which can change the floating-point result, and max_steps / num_steps set the
# learning-rate schedule.
COSMETIC_KEYS = ("log_every", "save_every", "keep_last")
# model settings that change what a step costs, not what it computes (up to float rounding): a run
# resumes across a change of them
EXECUTION_KEYS = ("packing", "logits_chunk", "compile", "gradient_checkpointing")


def stage_fingerprint(cfg: DareConfig, stage: str, inputs: dict[str, Path], cosmetic: tuple = ()) -> Fingerprint:
    """The fingerprint of a training stage: the model section, the stage's section without its
    cosmetic keys (`COSMETIC_KEYS` and the stage's own `cosmetic`), the seed, the ZeRO stage, the
    number of ranks and of sequence-parallel ranks (they decide the data order and the checkpoint
    layout), the optimizer's offload, and `inputs`. (launch.offload_params is left out: the checkpoints of ZeRO-3 with and without it
    are the same, and resume to the same weights.)"""
    section = {k: v for k, v in to_dict(getattr(cfg, stage)).items() if k not in COSMETIC_KEYS + cosmetic}
    model = {k: v for k, v in to_dict(cfg.model).items() if k not in EXECUTION_KEYS}
    launch: dict = {"zero_stage": cfg.launch.zero_stage}
    if cfg.launch.offload_optimizer != "none":
        # another optimizer (DeepSpeedCPUAdam): DeepSpeed cannot load torch AdamW's state into it.
        # Recorded only when on, so that checkpoints made before the setting existed still resume
        launch["offload_optimizer"] = cfg.launch.offload_optimizer
    if cfg.launch.sequence_parallel > 1:
        # the groups divide the data (training/parallel.py): another N is another data order
        launch["sequence_parallel"] = cfg.launch.sequence_parallel
    settings = {"model": model, stage: section, "run": {"seed": cfg.run.seed}, "launch": launch,
                "world_size": planned_world_size()}
    return Fingerprint.of(settings, inputs)



def input_fingerprint(path: Path) -> str:
    """Content hash of a data file; for a folder (a model), names, sizes and mtimes of its files
    (hashing an 8B checkpoint's bytes would take minutes)."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(path.rglob("*")):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.relative_to(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
