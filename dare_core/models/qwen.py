"""The Qwen2/Qwen3 checkpoint layout shared by Dream and SDAR (dense and MoE): config fields and
weight names. Not a family by itself."""
from __future__ import annotations

from typing import Optional

from dare_core.models.transformer import MoEConfig, TransformerConfig


def qwen_config(cfg: dict, qkv_bias: bool, qk_norm: bool, moe: Optional[MoEConfig] = None, moe_layers: tuple = ()) -> TransformerConfig:
    if cfg.get("rope_scaling"):
        raise ValueError(f"{cfg.get('model_type')}: rope_scaling={cfg['rope_scaling']!r} is not supported")
    return TransformerConfig(
        vocab_size=cfg["vocab_size"],
        d_model=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        mlp_hidden_size=cfg["intermediate_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 32768),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_size=cfg.get("head_dim"),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        rope_fp32=False,
        moe=moe,
        moe_layers=moe_layers,
    )


def qwen_name_map(qkv_bias: bool = False, qk_norm: bool = False, moe: bool = False) -> list[tuple[str, str]]:
    layer = "model.layers.{i}"
    names = [
        ("embed.weight", "model.embed_tokens.weight"),
        ("layers.{i}.attn_norm.weight", f"{layer}.input_layernorm.weight"),
        ("layers.{i}.mlp_norm.weight", f"{layer}.post_attention_layernorm.weight"),
        ("layers.{i}.attn.o_proj.weight", f"{layer}.self_attn.o_proj.weight"),
        ("norm.weight", "model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]
    for proj in ("q_proj", "k_proj", "v_proj"):
        names.append((f"layers.{{i}}.attn.{proj}.weight", f"{layer}.self_attn.{proj}.weight"))
        if qkv_bias:
            names.append((f"layers.{{i}}.attn.{proj}.bias", f"{layer}.self_attn.{proj}.bias"))
    if qk_norm:
        names += [("layers.{i}.attn.q_norm.weight", f"{layer}.self_attn.q_norm.weight"),
                  ("layers.{i}.attn.k_norm.weight", f"{layer}.self_attn.k_norm.weight")]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names.append((f"layers.{{i}}.mlp.{proj}.weight", f"{layer}.mlp.{proj}.weight"))
        if moe:
            names.append((f"layers.{{i}}.mlp.experts.{{e}}.{proj}.weight", f"{layer}.mlp.experts.{{e}}.{proj}.weight"))
    if moe:
        names.append(("layers.{i}.mlp.router.weight", f"{layer}.mlp.gate.weight"))
    return names
