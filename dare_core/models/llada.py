"""LLaDA family (LLaDA-8B-Base/Instruct, LLaDA-1.5): OLMo-style config fields and weight names,
bidirectional attention, unshifted logits."""
from __future__ import annotations

from typing import Optional

from dare_core.models.registry import Family, ModelLoadError, register_family
from dare_core.models.transformer import TransformerConfig

# config.json fields of a LLaDA checkpoint that describe its on-disk format; a from-scratch model
# carries them so that it is a LLaDA checkpoint like any other
LLADA_CONFIG_TEMPLATE = {
    "model_type": "llada",
    "architectures": ["LLaDAModelLM"],
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModel": "modeling_llada.LLaDAModelLM",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
    },
    "activation_type": "silu",
    "alibi": False,
    "attention_layer_norm": False,
    "bias_for_layer_norm": False,
    "block_type": "llama",
    "include_bias": False,
    "include_qkv_bias": False,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "rope": True,
    "rope_full_precision": True,
    "scale_logits": False,
    "weight_tying": False,
    "use_cache": False,
}

# fields our stack does not implement: refuse rather than compute something else
_REQUIRED = {
    "block_type": "llama", "alibi": False, "rope": True, "layer_norm_type": "rms",
    "include_bias": False, "attention_layer_norm": False, "scale_logits": False, "input_emb_norm": False,
}


def config_from_hf(cfg: dict) -> TransformerConfig:
    for key, want in _REQUIRED.items():
        if key in cfg and cfg[key] != want:
            raise ModelLoadError(f"llada config: {key}={cfg[key]!r} is not supported (expected {want!r})")
    d_model, n_heads = cfg["d_model"], cfg["n_heads"]
    return TransformerConfig(
        vocab_size=cfg.get("embedding_size") or cfg["vocab_size"],
        d_model=d_model,
        n_layers=cfg["n_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("n_kv_heads") or n_heads,
        mlp_hidden_size=cfg.get("mlp_hidden_size") or cfg.get("mlp_ratio", 4) * d_model,
        max_sequence_length=cfg.get("max_sequence_length", 4096),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(cfg.get("weight_tying", False)),
    )


def tiny_config(vocab_size: int, mask_token_id: int, eos_token_id: int, pad_token_id: Optional[int] = None, **sizes) -> dict:
    """A LLaDA config.json for a small model trained from scratch (sizes override the defaults)."""
    cfg = dict(LLADA_CONFIG_TEMPLATE)
    cfg.update(
        d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden_size=384, max_sequence_length=128,
        rope_theta=10000.0, rms_norm_eps=1e-5, init_std=0.02,
    )
    cfg.update(sizes)
    padded_vocab = -(-vocab_size // 8) * 8
    cfg.update(
        vocab_size=padded_vocab, embedding_size=padded_vocab, mask_token_id=mask_token_id,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id if pad_token_id is None else pad_token_id,
    )
    return cfg


LLADA = register_family(
    Family(
        model_type="llada",
        config_from_hf=config_from_hf,
        tiny_config=tiny_config,
        name_map=[
            ("embed.weight", "model.transformer.wte.weight"),
            ("layers.{i}.attn_norm.weight", "model.transformer.blocks.{i}.attn_norm.weight"),
            ("layers.{i}.attn.q_proj.weight", "model.transformer.blocks.{i}.q_proj.weight"),
            ("layers.{i}.attn.k_proj.weight", "model.transformer.blocks.{i}.k_proj.weight"),
            ("layers.{i}.attn.v_proj.weight", "model.transformer.blocks.{i}.v_proj.weight"),
            ("layers.{i}.attn.o_proj.weight", "model.transformer.blocks.{i}.attn_out.weight"),
            ("layers.{i}.mlp_norm.weight", "model.transformer.blocks.{i}.ff_norm.weight"),
            ("layers.{i}.mlp.gate_proj.weight", "model.transformer.blocks.{i}.ff_proj.weight"),
            ("layers.{i}.mlp.up_proj.weight", "model.transformer.blocks.{i}.up_proj.weight"),
            ("layers.{i}.mlp.down_proj.weight", "model.transformer.blocks.{i}.ff_out.weight"),
            ("norm.weight", "model.transformer.ln_f.weight"),
            ("lm_head.weight", "model.transformer.ff_out.weight"),
        ],
    )
)
