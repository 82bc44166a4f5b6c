"""Reading a finished training checkpoint: the one `latest` names, its weights (gathered from the
ZeRO-3 shards where needed) and its conversion into a Hugging Face folder (the `convert` stage)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dare_core.artifacts import CHECKPOINT_MARKER
from dare_core.errors import UserError
from dare_core.storage import read_json

META = CHECKPOINT_MARKER  # a checkpoint is complete once this file is in it (locally and remotely)
# a weights-only checkpoint's one file: the module's state dict, as DeepSpeed's ZeRO-0 model file holds it
WEIGHTS_FILE = "weights.pt"


def latest_checkpoint(ckpt_dir: Path) -> tuple[str, dict]:
    """The tag `latest` names in `ckpt_dir` and its DARE metadata; an error naming the missing or
    broken file otherwise (reads only: a stage checks this before it writes anything)."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"{pointer}: no checkpoint (did the training stage finish?)")
    tag = pointer.read_text().strip()
    meta_path = ckpt_dir / tag / META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path}: missing ('latest' names checkpoint {tag})")
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or not isinstance(meta.get("hf_config"), dict):
        raise UserError(f"{meta_path}: no 'hf_config' (not a DARE checkpoint?)")
    for alternatives in weight_files(meta):
        if not any((ckpt_dir / tag / name).is_file() for name in alternatives):
            raise FileNotFoundError(f"{ckpt_dir / tag / alternatives[0]}: missing")
    return tag, meta


def weight_files(meta: dict) -> list[tuple[str, ...]]:
    """The DeepSpeed files that hold a checkpoint's weights (each as its possible names): the whole
    module (ZeRO 0-2), or under ZeRO-3 rank 0's module layout and every rank's shard of the fp32
    weights (`bf16_`-prefixed in a bf16 run; the number of ranks is in the fingerprint's settings);
    or a weights-only checkpoint's one file."""
    if meta.get("weights_only"):
        return [(WEIGHTS_FILE,)]
    if meta.get("zero_stage", 0) < 3:
        return [("mp_rank_00_model_states.pt",)]
    ranks = int(meta.get("settings", {}).get("world_size", 1))
    shards = [(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
              for r in range(ranks)]
    return [("zero_pp_rank_0_mp_rank_00_model_states.pt",), *shards]


def checkpoint_state_dict(ckpt_dir: Path, tag: Optional[str] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Module weights (our generic names, without the `net.` prefix) and the DARE metadata of a
    DeepSpeed checkpoint (ZeRO-3 shards are gathered with DeepSpeed's own consolidation) or of a
    weights-only one."""
    ckpt_dir = Path(ckpt_dir)
    if tag is None:
        tag, meta = latest_checkpoint(ckpt_dir)
    else:
        meta = read_json(ckpt_dir / tag / META)
    if meta.get("weights_only"):
        state = torch.load(ckpt_dir / tag / WEIGHTS_FILE, map_location="cpu", weights_only=True)["module"]
    elif meta.get("zero_stage", 0) >= 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # the ranks' shards of the fp32 master weights, joined; then each in the dtype the module
        # trained in (rank 0's module layout keeps an empty tensor of it per parameter): a bf16 run
        # converts to the bf16 weights it trained with (the master weights rounded, as DeepSpeed
        # rounds them after every step), as a ZeRO 0-2 checkpoint does, not to float32
        layout = torch.load(ckpt_dir / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu",
                            weights_only=False)["module"]
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        state = {k: v.to(layout[k].dtype) if k in layout else v for k, v in state.items()}
    else:
        state = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    prefix = "net."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}, meta


def convert_checkpoint(ckpt_dir: Path, out_dir: Path, tokenizer_dir: Optional[Path] = None, tag: Optional[str] = None,
                       sampler: Optional[dict] = None) -> Path:
    """Training checkpoint -> Hugging Face folder (a LoRA adapter merged into the weights), verified:
    the written config and every written tensor must reproduce the checkpoint's model bit for bit.

    The checkpoint's tensors become the model's (built on the meta device, assigned, no random init
    and no copy), and the export streams them, so the host holds the weights once."""
    from dare_core.models.lm import build_model
    from dare_core.models.hf_folder import save_model, verify_saved

    state, meta = checkpoint_state_dict(ckpt_dir, tag)
    model = build_model(meta["hf_config"], device="meta")
    if meta.get("lora"):
        from dare_core.models.lora import LoraSettings, apply_lora

        apply_lora(model, LoraSettings(**meta["lora"]))  # adapter modules on meta too: the state fills them
    model.net.load_state_dict(state, strict=True, assign=True)
    if model.config.tie_embeddings:
        model.net.lm_head.weight = model.net.embed.weight
    model.eval()
    save_model(model, out_dir, extra_files={"tokenizer": tokenizer_dir} if tokenizer_dir else None, sampler=sampler)
    # tensor by tensor rather than a reload and two forwards: same guarantee, no second copy of the
    # model in memory and no 8B forward on the CPU
    verify_saved(model, out_dir)
    return Path(out_dir)
