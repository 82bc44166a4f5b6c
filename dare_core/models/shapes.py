"""The shape rules of a transformer config, checked when the config is built: a model folder's
config.json or `model.init` that breaks one is refused with the field's name before a weight is
allocated or a file written (a zero head count or a width given as text would otherwise surface as
a ZeroDivisionError or a TypeError deep in the model's construction, or, for key/value heads that do
not divide the heads, only at the first forward, after the stage had written its base model)."""
from __future__ import annotations

import math
from typing import Any, Optional

# (field, what it is): every one a positive whole number
POSITIVE_INTS = (("vocab_size", "the vocabulary size"), ("d_model", "the width"), ("n_layers", "the number of layers"),
                 ("n_heads", "the number of attention heads"), ("n_kv_heads", "the number of key/value heads"),
                 ("mlp_hidden_size", "the MLP width"), ("max_sequence_length", "the maximum sequence length"))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_shapes(cfg: Any) -> None:
    """ValueError naming the field of `cfg` (a TransformerConfig) that breaks a shape rule."""
    for name, what in POSITIVE_INTS:
        value = getattr(cfg, name)
        if not _positive_int(value):
            raise ValueError(f"{name} ({what}) must be a positive whole number, got {value!r}")
    for name in ("head_size", "rotary_dim"):
        value = getattr(cfg, name)
        if value is not None and not _positive_int(value):
            raise ValueError(f"{name} must be a positive whole number (or absent), got {value!r}")
    if cfg.head_size is None and cfg.d_model % cfg.n_heads:
        raise ValueError(f"n_heads ({cfg.n_heads}) must divide the width d_model ({cfg.d_model}): each head gets "
                         f"d_model / n_heads dimensions")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"n_kv_heads ({cfg.n_kv_heads}) must divide n_heads ({cfg.n_heads}): each key/value head "
                         f"serves the same number of query heads")
    head_dim = cfg.head_size or cfg.d_model // cfg.n_heads
    rotary: Optional[int] = cfg.rotary_dim
    if head_dim % 2 or (rotary is not None and (rotary % 2 or rotary > head_dim)):
        shown = rotary if rotary is not None else head_dim
        raise ValueError(f"the rotated part of each head (rotary_dim {shown}) must be even and at most the head "
                         f"width ({head_dim})")
    for name in ("rope_theta", "rms_norm_eps"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
