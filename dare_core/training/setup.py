"""Model and tokenizer for a stage: a checkpoint folder, or a from-scratch model of a family."""
from __future__ import annotations

from typing import Optional

import torch

from dare_core.config import ConfigError, DareConfig
from dare_core.devices import resolve_dtype
from dare_core.diffusion.seeding import generator
from dare_core.inputs import model_folder, tokenizer_folder
from dare_core.models.family import get_family
from dare_core.models.hf_folder import inspect_model, load_model
from dare_core.models.lm import DiffusionLM, build_model, empty_model
from dare_core.models.tokenizer import Tokenizer, load_tokenizer


def stage_tokenizer(cfg: DareConfig) -> Tokenizer:
    return load_tokenizer(tokenizer_folder(cfg))


def _scratch_config(cfg: DareConfig, tokenizer: Tokenizer) -> dict:
    """config.json of a from-scratch model of `model.family` sized by `model.init`."""
    try:
        family = get_family(cfg.model.family)
    except ValueError as exc:
        raise ConfigError(f"model.family: {exc}") from None
    if family.tiny_config is None:
        raise ConfigError(f"model.family: '{cfg.model.family}' cannot be initialised from scratch (set model.path)")
    family.check_init(cfg.model.init)
    try:
        return family.tiny_config(tokenizer.vocab_size, tokenizer.mask_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                  **cfg.model.init)
    except TypeError as exc:  # a size the family does not have
        raise ConfigError(f"model.init: {exc}") from None


def initial_spec(cfg: DareConfig, tokenizer: Tokenizer) -> DiffusionLM:
    """The model SFT will train, on the meta device (no weights read, no memory), with LoRA applied
    as configured: its sizes, family and parameter count for the checks made before anything is
    loaded or written. `model.path`'s folder is checked as far as possible without its weights."""
    if cfg.model.path:
        model = inspect_model(model_folder(cfg))
    else:
        hf_config = _scratch_config(cfg, tokenizer)
        try:
            model = build_model(hf_config, device="meta")
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            raise ConfigError(f"model.init: {exc}") from None
    return prepare_for_training(model, cfg)


def initial_model(cfg: DareConfig, tokenizer: Tokenizer, device: Optional[torch.device] = None) -> DiffusionLM:
    """The model SFT starts from: `model.path` if set, else a seeded from-scratch init of `model.family`."""
    dtype = resolve_dtype(cfg.model.dtype)
    device = torch.device(device or "cpu")
    if cfg.model.path:
        model = load_model(model_folder(cfg), dtype=dtype, device=device)
    else:
        # allocated on the device in the training dtype and drawn there: a CPU init is the same
        # tensors as ever (float32 draws, cast); a GPU's generator is seeded from the same seed
        model = empty_model(_scratch_config(cfg, tokenizer), device=device, dtype=dtype)
        model.net.init_weights(generator(cfg.run.seed, "init", device=device))
    return prepare_for_training(model, cfg)


def prepare_for_training(model: DiffusionLM, cfg: DareConfig) -> DiffusionLM:
    """Packing, logits-free scoring, compilation, gradient checkpointing and LoRA, as configured."""
    model.packing = cfg.model.packing
    model.logits_chunk = cfg.model.logits_chunk
    model.net.compile_training = cfg.model.compile
    if cfg.model.gradient_checkpointing:
        model.set_gradient_checkpointing(True)
    if cfg.model.lora is not None:
        from dare_core.config import from_dict
        from dare_core.models.lora import LoraSettings, apply_lora

        device = next(model.net.parameters()).device
        draws = generator(cfg.run.seed, "lora", device=device) if device.type != "meta" else None
        apply_lora(model, from_dict(LoraSettings, cfg.model.lora, "model.lora"), draws)
    return model
