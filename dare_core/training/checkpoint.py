"""Training checkpoints: atomic DeepSpeed saves (write under a temporary tag, rename, then move the
`latest` pointer), keep the last K, refuse a checkpoint made under a different config, and
conversion of a checkpoint into a Hugging Face folder."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from dare_core.storage import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

META = "dare_checkpoint.json"


class CheckpointManager:
    def __init__(self, directory: Path, keep_last: int, fingerprint: str):
        self.dir = Path(directory)
        self.keep_last = max(1, keep_last)
        self.fingerprint = fingerprint

    def latest_tag(self) -> Optional[str]:
        """The last complete checkpoint made under the same config, or None (start fresh)."""
        pointer = self.dir / "latest"
        if not pointer.exists():
            return None
        tag = pointer.read_text().strip()
        meta_path = self.dir / tag / META
        if not meta_path.exists():
            log.warning("checkpoint %s has no %s; ignoring it", self.dir / tag, META)
            return None
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") != self.fingerprint:
            # made under another config or data: resuming would mix two runs, so they are discarded
            log.warning("checkpoints in %s were made with a different config or data; starting fresh", self.dir)
            self.clear()
            return None
        return tag

    def clear(self) -> None:
        if self.dir.exists():
            for child in self.dir.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()

    def save(self, engine, step: int, client_state: dict, hf_config: dict) -> str:
        tag = f"step{step:08d}"
        tmp_tag = f".tmp-{tag}"
        shutil.rmtree(self.dir / tmp_tag, ignore_errors=True)
        engine.save_checkpoint(str(self.dir), tag=tmp_tag, client_state=client_state, save_latest=False)
        if engine.global_rank == 0:
            lora = getattr(engine.module, "lora", None)
            atomic_write_json(self.dir / tmp_tag / META, {"fingerprint": self.fingerprint, "step": step, "hf_config": hf_config,
                                                          "zero_stage": engine.zero_optimization_stage(),
                                                          "lora": dataclasses.asdict(lora) if lora is not None else None})
            shutil.rmtree(self.dir / tag, ignore_errors=True)
            os.replace(self.dir / tmp_tag, self.dir / tag)
            atomic_write_text(self.dir / "latest", tag)
            self._prune(keep=tag)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return tag

    def resume(self, engine, what: str) -> int:
        """Load the last usable checkpoint into `engine`; returns the step to continue from (0: fresh)."""
        tag = self.latest_tag()
        if tag is None:
            return 0
        _, client_state = engine.load_checkpoint(str(self.dir), tag=tag)
        step = (client_state or {})["step"]
        log.info("resuming %s from %s (step %d)", what, tag, step)
        return step

    def _prune(self, keep: str) -> None:
        tags = sorted(p.name for p in self.dir.glob("step*") if p.is_dir())
        for old in tags[: -self.keep_last]:
            if old != keep:
                shutil.rmtree(self.dir / old, ignore_errors=True)
        for stale in self.dir.glob(".tmp-step*"):
            shutil.rmtree(stale, ignore_errors=True)


def checkpoint_state_dict(ckpt_dir: Path, tag: Optional[str] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Module weights (our generic names, without the `net.` prefix) and the DARE metadata of a
    DeepSpeed checkpoint; ZeRO-3 shards are gathered with DeepSpeed's own consolidation."""
    ckpt_dir = Path(ckpt_dir)
    if tag is None:
        pointer = ckpt_dir / "latest"
        if not pointer.exists():
            raise FileNotFoundError(f"{pointer}: no checkpoint to convert (did the training stage finish?)")
        tag = pointer.read_text().strip()
    meta = json.loads((ckpt_dir / tag / META).read_text())
    if meta.get("zero_stage", 0) >= 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        state = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    prefix = "net."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}, meta


def config_fingerprint(*parts: Any) -> str:
    """What a run's checkpoints belong to: a resumed run must have the same config and inputs."""
    import hashlib

    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def input_fingerprint(path: Path) -> str:
    """Content hash of a data file; for a folder (a model), names, sizes and mtimes of its files
    (hashing an 8B checkpoint's bytes would take minutes)."""
    import hashlib

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


def convert_checkpoint(ckpt_dir: Path, out_dir: Path, tokenizer_dir: Optional[Path] = None, tag: Optional[str] = None,
                       sampler: Optional[dict] = None) -> Path:
    """Training checkpoint -> Hugging Face folder; verified by reloading it to identical logits."""
    from dare_core.models.registry import build_model, load_model, save_model

    state, meta = checkpoint_state_dict(ckpt_dir, tag)
    model = build_model(meta["hf_config"], device="meta")
    if meta.get("lora"):
        from dare_core.models.lora import LoraSettings, apply_lora

        model = build_model(meta["hf_config"])
        apply_lora(model, LoraSettings(**meta["lora"]))
        model.net.load_state_dict(state, strict=True)
    else:
        model.net.load_state_dict(state, strict=True, assign=True)
    model.eval()
    save_model(model, out_dir, extra_files={"tokenizer": tokenizer_dir} if tokenizer_dir else None, sampler=sampler)
    reloaded = load_model(out_dir).eval()
    probe = torch.arange(min(16, model.max_sequence_length))[None] % model.config.vocab_size
    with torch.no_grad():
        if not torch.equal(model(probe), reloaded(probe)):
            raise RuntimeError(f"{out_dir}: reloaded model does not reproduce the checkpoint's logits")
    return Path(out_dir)
