"""Tiny checkpoint folders (char tokenizer, random weights) for the evaluation tests."""
from __future__ import annotations

import os
from pathlib import Path

from dare_core.diffusion.seeding import generator
from dare_core.models.family import get_family
from dare_core.models.hf_folder import save_model
from dare_core.models.lm import build_model
from dare_core.models.tokenizer import build_char_tokenizer

TESTS = Path(__file__).resolve().parent
SIZES = {
    "llada": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden_size": 32, "max_sequence_length": 4096},
    "Dream": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 32, "max_position_embeddings": 4096},
    "sdar": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
             "intermediate_size": 32, "max_position_embeddings": 4096},
    "diffusion_gemma": {"max_position_embeddings": 4096, "canvas_length": 8},
}


def tiny_folder(root: Path, family: str = "llada", seed: int = 0, sampler: dict | None = None) -> Path:
    """A saved random model of `family` with the char tokenizer, as a checkpoint folder."""
    tok = build_char_tokenizer(root / f"tok_{family}")
    model = build_model(get_family(family).tiny_config(tok.vocab_size, tok.mask_token_id, tok.eos_token_id, **SIZES[family]))
    model.net.init_weights(generator(seed, "eval", family), std=0.3)
    return save_model(model, root / f"{family}_{seed}", extra_files={"tokenizer": root / f"tok_{family}"}, sampler=sampler)


def opencompass_env() -> dict:
    """The OpenCompass subprocess must import the scripted test models (tests/eval_oracle.py)."""
    return {"PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
