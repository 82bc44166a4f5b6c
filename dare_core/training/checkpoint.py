"""Training checkpoints: atomic DeepSpeed saves (write under a temporary tag, rename, then move the
`latest` pointer), keep the last K, written where `SavePolicy` says (optimizer state only at resume
points), refuse (never silently discard) checkpoints made with other settings or inputs, and keep
every set a fresh start displaces (superseded.py). Reading a finished one: checkpoint_io.py."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from dare_core.artifacts import ArtifactRoot
from dare_core.errors import UserError
from dare_core.ownership import STAGE_OFF_NOTE
from dare_core.remote import RemoteError, file_lock
from dare_core.storage import atomic_write_json, atomic_write_text, read_json
from dare_core.training import superseded as sets_aside
# reading a finished checkpoint (convert, eval) lives in checkpoint_io.py; importable from here too
from dare_core.training.checkpoint_io import (META, WEIGHTS_FILE, checkpoint_state_dict,  # noqa: F401
                                              convert_checkpoint, latest_checkpoint, weight_files)
from dare_core.training.engine import whole_weights
from dare_core.training.fingerprint import Fingerprint

log = logging.getLogger(__name__)

FULL, WEIGHTS = "full", "weights"


class CheckpointMismatch(UserError):
    """Checkpoints that do not belong to this run (other settings or inputs): never discarded silently."""


@dataclass(frozen=True)
class SavePolicy:
    """Which checkpoint a training stage writes after a step. A full one (the weights, the fp32
    master copy and Adam's moments: about 16 bytes a parameter) only where a resume point is due,
    at multiples of `save_every`. After the last step, when it is none, the weights alone, which
    `convert` reads and a rerun takes as the end of training; or nothing where the stage `exports`
    its final weights anyway (SFT, preference): a run killed before its export resumes from the
    last full checkpoint and trains the rest again."""

    save_every: int
    last_step: int
    exports: bool

    def kind(self, step: int) -> Optional[str]:
        """FULL, WEIGHTS or None (no checkpoint) after `step` (1-based)."""
        if step % self.save_every == 0:
            return FULL
        return WEIGHTS if step == self.last_step and not self.exports else None

    def kinds(self, start: int) -> list[str]:
        """What a run that continues from step `start` writes, in order."""
        full = self.last_step // self.save_every - start // self.save_every
        final = [WEIGHTS] if start < self.last_step and self.kind(self.last_step) == WEIGHTS else []
        return [FULL] * full + final


SUPERSEDED = "superseded"


class CheckpointManager:
    """The checkpoints of one training stage under `directory`.

    `check()` runs with the stage's other checks, before anything is written: it returns the
    checkpoint to resume from, or (restart "never") raises CheckpointMismatch when the checkpoints
    were made with other settings or inputs, naming what changed. Only `begin()`, right before
    training, acts: it loads the checked checkpoint, or, when the run starts fresh over existing
    checkpoints (restart "always", or "if_changed" and they do not match), moves them to
    `<stage>/superseded/NNNN/` (every set kept, newest last: training/superseded.py) so that no
    checkpoint is ever deleted because settings changed. Unless restart is "always", a run whose
    settings match a set kept there (a change reverted) resumes from that set, moved back.

    With `mirror` (run.artifact_root), rank 0 uploads each checkpoint once it is complete, and a
    run without local checkpoints resumes from the artifact root's latest one (a run continued
    on another machine).

    `policy` decides what `after_step` writes; a weights-only checkpoint (its last step) is resumed
    only where there is nothing left to train and nothing after training reads the engine's
    weights: never as the start of more training."""

    def __init__(self, directory: Path, keep_last: int, fingerprint: Fingerprint, stage: str, restart: str = "never",
                 checkpoint_bytes: int = 0, mirror: Optional[ArtifactRoot] = None, policy: Optional[SavePolicy] = None,
                 weights_bytes: int = 0, protect: Optional[Callable[[list[str]], set[str]]] = None):
        self.dir = Path(directory)
        self.keep_last = keep_last
        # tags -> those of them pruning keeps beyond the last keep_last (RL's best validated one)
        self.protect = protect
        self.fingerprint = fingerprint
        self.stage = stage
        self.restart = restart
        # about the size of a full and of a weights-only checkpoint (training/preflight.py): the disk
        # check's estimate, and what tells a full disk from other write failures
        self.checkpoint_bytes = checkpoint_bytes
        self.weights_bytes = weights_bytes
        self.mirror = mirror
        self.policy = policy
        self._tag: Optional[str] = None
        self._meta: dict = {}  # the DARE metadata of the checkpoint to resume
        self._set_aside: Optional[str] = None  # why the existing checkpoints are set aside in begin()
        self._source: Optional[Path] = None  # a superseded set that begin() moves back to resume it

    @property
    def superseded(self) -> Path:
        return self.dir.parent / SUPERSEDED

    def _refuse(self, why: str, revertible: bool = True) -> CheckpointMismatch:
        way_back = ", or revert the change to resume them" if revertible else ""
        return CheckpointMismatch(f"{self.dir}: {why}; run `dare stage {self.stage} --restart` to set them aside "
                                  f"(into {self.superseded}) and start fresh{way_back}")

    def _mismatch(self) -> Optional[tuple[str, bool]]:
        """(why, revertible) when the last checkpoint is not one to resume, else None (reads only;
        sets self._tag to the checkpoint to resume)."""
        tag = (self.dir / "latest").read_text().strip()
        meta_path = self.dir / tag / META
        if not meta_path.is_file():
            return f"'latest' names checkpoint {tag}, which is missing or has no {META}", False
        meta = read_json(meta_path)
        if "settings" not in meta:
            return ("the checkpoints were made by an older DARE that did not record their settings, so they cannot be "
                    "checked against this run"), False
        if meta.get("fingerprint") != self.fingerprint.digest:
            changes = self.fingerprint.changes(meta) or ["the settings' fingerprint"]
            shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
            return f"the checkpoints were made with other settings or inputs ({shown})", True
        if meta.get("weights_only") and not self._ends_here(meta["step"]):
            return (f"the last checkpoint, {tag}, holds the weights of step {meta['step']} only (no optimizer state): "
                    f"training cannot continue from it"), False
        self._tag, self._meta = tag, meta
        return None

    def _resumable(self, meta: dict) -> bool:
        """Whether a checkpoint with DARE metadata `meta` is one this run resumes."""
        return meta.get("fingerprint") == self.fingerprint.digest and (
            not meta.get("weights_only") or self._ends_here(meta["step"]))

    def _from_superseded(self) -> bool:
        """Find the newest set in superseded/ made with this run's settings and inputs; with one,
        note it (begin() moves it back) and its last checkpoint as the one to resume. Reads only."""
        found = sets_aside.find_matching(self.superseded, self._resumable)
        if found is None:
            return False
        self._source, self._tag, self._meta = found
        return True

    def _ends_here(self, step: int) -> bool:
        """Whether a weights-only checkpoint of `step` ends this run: nothing left to train, and no
        export after training that would read the engine's (then untrained) weights."""
        return self.policy is not None and step == self.policy.last_step and not self.policy.exports

    def _holds_anything(self) -> bool:
        """Whether the folder holds more than an off stage's note (ownership.leave_stage_off_note)."""
        return self.dir.is_dir() and any(p.name != STAGE_OFF_NOTE for p in self.dir.iterdir())

    def check(self) -> Optional[str]:
        """The tag of the last checkpoint, made under this fingerprint; None when the run starts
        fresh. Reads only; but with an artifact root and no local checkpoint, it first fetches the
        artifact root's latest one, if made with these settings (`_restore`)."""
        self._tag, self._set_aside, self._source = None, None, None
        if self.mirror is not None and self.restart != "always":
            # every rank of the job checks; the first fetches, the others wait and find it here
            with file_lock(str(self.dir.absolute())):
                if not (self.dir / "latest").exists():
                    self._restore()
        if not (self.dir / "latest").exists():
            if self.restart == "always" and self._holds_anything():
                self._set_aside = "--restart"
            if self.restart != "always" and self._from_superseded():
                if self._holds_anything():
                    self._set_aside = "the checkpoints of these settings were found in " + str(self._source)
                return self._tag
            return None
        if self.restart == "always":
            self._set_aside = "--restart"
            return None
        mismatch = self._mismatch()
        if mismatch is None:
            return self._tag
        why, revertible = mismatch
        if revertible and self._from_superseded():
            # a change reverted: these settings' own checkpoints were kept in superseded/; the
            # current ones take their place there
            self._set_aside = why
            return self._tag
        if self.restart == "if_changed":
            self._set_aside = why
            return None
        raise self._refuse(why, revertible)

    def _restore(self) -> None:
        """No local checkpoint: fetch the artifact root's latest one if it was made with these
        settings and inputs. One made with others is not fetched: refused like a local one, or
        (restart "if_changed") left where it is while the run starts fresh."""
        found = self.mirror.latest_checkpoint(self.dir)
        if found is None:
            return
        tag, meta, url = found
        if meta.get("fingerprint") != self.fingerprint.digest:
            changes = self.fingerprint.changes(meta) if "settings" in meta else []
            why = f"made with other settings or inputs ({'; '.join(changes[:6]) or 'the fingerprint'})"
            if self.restart == "if_changed":
                log.warning("%s: not resumed, %s; starting fresh (it stays in the artifact root)", url, why)
                return
            raise CheckpointMismatch(f"{url}: the artifact root's checkpoint was {why}; run `dare stage {self.stage} "
                                     f"--restart` to start fresh (it stays there), or revert the change to resume it")
        self.mirror.fetch_checkpoint(self.dir, tag)

    def begin(self, engine, what: str) -> int:
        """Right before the first step, after every check: the step to continue from (0: fresh).
        Checkpoints that are not resumed are set aside now, and only now. The folder exists from
        here on, whether or not the run writes a checkpoint into it."""
        if self._set_aside is not None or self._source is not None:
            if engine.global_rank == 0:
                source = self._source
                if source is not None and source == self.superseded:  # an older DARE's set: numbered first
                    source = sets_aside.migrate_legacy(self.superseded)
                if self._set_aside is not None:
                    self.set_aside(self._set_aside)
                if source is not None:
                    sets_aside.restore(source, self.dir)
                    log.warning("%s: the checkpoints made with these settings were kept in %s: moved back to resume "
                                "them", self.dir, source)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
        if engine.global_rank == 0:
            # the folder is a declared output of the stage (dvc.yaml) even where the run is shorter
            # than save_every and writes no checkpoint into it
            self.dir.mkdir(parents=True, exist_ok=True)
        if self._tag is None:
            return 0
        if self._meta.get("weights_only"):
            log.info("resuming %s from %s (step %d, the last; weights only: nothing left to train)", what, self._tag,
                     self._meta["step"])
            return self._meta["step"]
        _, client_state = engine.load_checkpoint(str(self.dir), tag=self._tag)
        step = (client_state or {})["step"]
        log.info("resuming %s from %s (step %d)", what, self._tag, step)
        return step

    @property
    def resumed(self) -> Optional[Path]:
        """After `begin()`: the folder of the checkpoint the run resumed from (None: a fresh start)."""
        return self.dir / self._tag if self._tag is not None else None

    def set_aside(self, why: str) -> None:
        """Move the checkpoints into `superseded/` as its newest set (every earlier set stays): a
        rename on the same disk, so it costs no space and no time."""
        kept = sets_aside.keep(self.dir, self.superseded, why)
        log.warning("%s: the previous checkpoints are kept in %s (%s)", self.dir, kept, why)

    def planned_writes(self) -> tuple[list[int], list[int]]:
        """After `check()`: the size of each checkpoint this run will write, in order (`policy`, from
        the step it starts at), and of those already in the folder that stay beside them (a resumed
        run's; a fresh start sets them aside, to the same disk)."""
        if self.policy is None:
            return [], []
        sizes = {FULL: self.checkpoint_bytes, WEIGHTS: self.weights_bytes}
        existing = [self.checkpoint_bytes] * len(self._tags(self._source)) if self._tag else []
        return [sizes[kind] for kind in self.policy.kinds(self._meta.get("step", 0))], existing

    def after_step(self, engine, step: int, hf_config: dict, rank_files: Optional[dict[str, Any]] = None) -> None:
        """Write the checkpoint `policy` asks for after `step`, if any; after the last step, when it
        is not a resume point, one line says what is written instead. `rank_files`: this rank's
        objects (file name -> object) a full checkpoint keeps beside the engine's state."""
        kind = self.policy.kind(step)
        if step == self.policy.last_step and kind != FULL and engine.global_rank == 0:
            instead = ("a checkpoint of the weights only (what `dare stage convert` reads; no optimizer state)" if kind == WEIGHTS
                       else "no checkpoint: the exported model holds the final weights")
            log.info("%s: the last step, %d, is not a multiple of %s.save_every (%d): %s", self.dir, step, self.stage,
                     self.policy.save_every, instead)
        if kind is not None:
            self.save(engine, step, {"step": step}, hf_config, weights_only=kind == WEIGHTS, rank_files=rank_files)

    def save(self, engine, step: int, client_state: dict, hf_config: dict, weights_only: bool = False,
             rank_files: Optional[dict[str, Any]] = None) -> str:
        """Write the checkpoint of `step`: DeepSpeed's whole training state and `rank_files` (each
        rank's own, torch.save'd), or (`weights_only`) the module's weights alone, in the training
        dtype."""
        tag = f"step{step:08d}"
        tmp = self.dir / f".tmp-{tag}"
        if engine.global_rank == 0:
            # the leftover of a killed save; one rank removes it, and DeepSpeed's barrier at the start
            # of save_checkpoint keeps every rank from writing before it is gone (a weights-only
            # checkpoint is rank 0's alone)
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            if weights_only:
                # whole on rank 0 (under ZeRO-3 every rank takes part in gathering them)
                with whole_weights(engine):
                    if engine.global_rank == 0:
                        tmp.mkdir(parents=True)
                        torch.save({"module": engine.module.state_dict()}, tmp / WEIGHTS_FILE)
            else:
                engine.save_checkpoint(str(self.dir), tag=tmp.name, client_state=client_state, save_latest=False)
                for name, obj in (rank_files or {}).items():
                    torch.save(obj, tmp / name)
                if rank_files and torch.distributed.is_initialized():
                    torch.distributed.barrier()  # every rank's files are in before rank 0 renames the folder
            if engine.global_rank == 0:
                lora = getattr(engine.module, "lora", None)
                atomic_write_json(tmp / META, {"fingerprint": self.fingerprint.digest, "settings": self.fingerprint.settings,
                                               "inputs": self.fingerprint.inputs, "step": step, "hf_config": hf_config,
                                               "zero_stage": engine.zero_optimization_stage(), "weights_only": weights_only,
                                               "lora": dataclasses.asdict(lora) if lora is not None else None})
                shutil.rmtree(self.dir / tag, ignore_errors=True)
                os.replace(tmp, self.dir / tag)
                atomic_write_text(self.dir / "latest", tag)
                pruned = self._prune(keep=tag)
                self._upload(pruned)
        except BaseException as exc:
            # a half-written checkpoint is never left behind (disk full, killed); the last complete
            # one and the `latest` pointer are untouched
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self.dir).free if self.dir.is_dir() else 0
            size = self.weights_bytes if weights_only else self.checkpoint_bytes
            if isinstance(exc, (OSError, RuntimeError)) and free < size:
                # torch.save reports a full disk as a RuntimeError
                raise UserError(f"{self.dir}: the disk is full: writing checkpoint {tag} needs about {size} "
                                f"bytes, {free} are free (the earlier checkpoints are intact)") from exc
            if isinstance(exc, OSError):
                raise UserError(f"{self.dir}: writing checkpoint {tag} failed (the earlier checkpoints are intact): {exc}") from exc
            raise
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return tag

    def _tags(self, folder: Optional[Path] = None) -> list[str]:
        return sorted(p.name for p in (folder or self.dir).glob("step*") if p.is_dir())

    def _prune(self, keep: str) -> list[str]:
        tags = self._tags()
        kept = {keep} | (self.protect(tags) if self.protect else set())
        pruned = [old for old in tags[: -self.keep_last] if old not in kept]
        for old in pruned:
            shutil.rmtree(self.dir / old, ignore_errors=True)
        (self.dir / STAGE_OFF_NOTE).unlink(missing_ok=True)  # a stage once off holds checkpoints now
        for stale in self.dir.glob(".tmp-step*"):
            shutil.rmtree(stale, ignore_errors=True)
        return pruned

    def _upload(self, pruned: list[str]) -> None:
        """Copy the new checkpoint (and any an earlier upload missed) to the artifact root. A failed
        upload does not stop training: the checkpoint is safe locally, and the next save, or the
        end of the stage, uploads what is missing (the end of the stage fails if it still cannot)."""
        if self.mirror is None:
            return
        try:
            self.mirror.sync_checkpoints(self.dir, pruned)
        except RemoteError as exc:
            log.warning("%s (the checkpoint is safe locally; the next save or the end of the stage uploads it)", exc)
