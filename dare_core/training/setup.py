"""Model and tokenizer for a stage: a checkpoint folder, or a from-scratch model of a family."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dare_core.config import DareConfig
from dare_core.diffusion.seeding import generator
from dare_core.models.registry import DiffusionLM, build_model, get_family, load_model
from dare_core.models.tokenizer import Tokenizer, load_tokenizer
from dare_core.training.engine import resolve_dtype


def stage_tokenizer(cfg: DareConfig) -> Tokenizer:
    return load_tokenizer(cfg.model.path or cfg.data.tokenizer_dir)


def tokenizer_folder(cfg: DareConfig) -> Path:
    return Path(cfg.model.path or cfg.data.tokenizer_dir)


def sampler_dict(cfg: DareConfig) -> dict:
    """The eval sampler settings, stored with exported checkpoints."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(cfg.eval.sampler).items() if k not in ("batch_size", "engine", "engine_args")}


def initial_model(cfg: DareConfig, tokenizer: Tokenizer, device: Optional[torch.device] = None) -> DiffusionLM:
    """The model SFT starts from: `model.path` if set, else a seeded from-scratch init of `model.family`."""
    dtype = resolve_dtype(cfg.model.dtype)
    if cfg.model.path:
        model = load_model(cfg.model.path, dtype=dtype, device=device or "cpu")
    else:
        family = get_family(cfg.model.family)
        if family.tiny_config is None:
            raise ValueError(f"family '{cfg.model.family}' cannot be initialised from scratch")
        hf_config = family.tiny_config(tokenizer.vocab_size, tokenizer.mask_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, **cfg.model.init)
        model = build_model(hf_config)
        model.net.init_weights(generator(cfg.run.seed, "init"))
        model = model.to(device=device or "cpu", dtype=dtype)
    return prepare_for_training(model, cfg)


def prepare_for_training(model: DiffusionLM, cfg: DareConfig) -> DiffusionLM:
    """Gradient checkpointing and LoRA, as configured."""
    if cfg.model.gradient_checkpointing:
        model.set_gradient_checkpointing(True)
    if cfg.model.lora is not None:
        from dare_core.config import from_dict
        from dare_core.models.lora import LoraSettings, apply_lora

        apply_lora(model, from_dict(LoraSettings, cfg.model.lora, "model.lora"))
    return model
