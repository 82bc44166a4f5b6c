"""LLaDA family (LLaDA-8B-Base/Instruct, LLaDA-1.5): OLMo-style config fields and weight names,
bidirectional attention, unshifted logits."""
from __future__ import annotations

from typing import Optional

from dare_core.models.family import FAMILIES, Family, register_family
from dare_core.models.hf_folder import ModelLoadError
from dare_core.models.llada2 import LING_TOKEN_IDS
from dare_core.models.qwen import qwen_name_map
from dare_core.models.transformer import MoEConfig, TransformerConfig

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


def _moe_variant(cfg: dict) -> Family:
    """LLaDA-MoE checkpoints also say model_type "llada" but use the Llama/OLMoE layout."""
    is_moe = "num_experts" in cfg or "LLaDAMoEModelLM" in (cfg.get("architectures") or [])
    return LLADA_MOE if is_moe else LLADA


LLADA = register_family(
    Family(
        model_type="llada",
        variant=_moe_variant,
        config_from_hf=config_from_hf,
        tiny_config=tiny_config,
        # LLaDA-8B's config.json and tokenizer: <|mdm_mask|>, <|endoftext|>
        default_token_ids={"mask": 126336, "eos": 126081},
        # LLaDA / LLaDA-1.5 / LLaDA-MoE are evaluated with low-confidence remasking in semi-autoregressive blocks
        sampler_defaults={"remasking": "low_confidence"},
        eval_label="LLaDA",
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


# ---- LLaDA-MoE (LLaDA-MoE-7B-A1B): per-head q/k RMSNorm, full RoPE, softmax top-k routing without
# renormalisation, bidirectional attention, unshifted logits. See docs/families/llada_moe.md.


def moe_config_from_hf(cfg: dict) -> TransformerConfig:
    if cfg.get("moe_router_enable_expert_bias"):
        raise ModelLoadError("LLaDA-MoE config: moe_router_enable_expert_bias is not supported")
    if cfg.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise ModelLoadError(f"LLaDA-MoE config: partial_rotary_factor={cfg['partial_rotary_factor']} is not supported")
    n_layers = cfg["num_hidden_layers"]
    freq = cfg.get("moe_layer_freq", 1)
    freq = freq if isinstance(freq, list) else [freq] * n_layers
    shared = cfg.get("shared_expert_intermediate_size")
    moe = MoEConfig(n_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"], hidden=cfg["expert_intermediate_size"],
                    router="softmax", norm_topk_prob=False, n_shared=1 if shared else 0)
    if shared and shared != cfg["expert_intermediate_size"]:
        raise ModelLoadError("LLaDA-MoE config: a shared expert wider than a routed one is not supported")
    return TransformerConfig(
        vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"], n_layers=n_layers, n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        mlp_hidden_size=cfg.get("dense_intermediate_size") or cfg["expert_intermediate_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 8192), rope_theta=float(cfg.get("rope_theta", 50000.0)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=bool(cfg.get("qk_layernorm", True)), rope_fp32=False, moe=moe,
        moe_layers=tuple(i for i, f in enumerate(freq) if f),
    )


def moe_tiny_config(vocab_size: int, mask_token_id: int, eos_token_id: int, pad_token_id: Optional[int] = None, **sizes) -> dict:
    cfg = {
        "model_type": "llada", "architectures": ["LLaDAMoEModelLM"],
        "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig", "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM"},
        "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "expert_intermediate_size": 64, "dense_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_layer_freq": 1, "qk_layernorm": True, "rope_theta": 50000.0, "partial_rotary_factor": 1.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False, "hidden_act": "silu",
    }
    cfg.update(sizes)
    padded = -(-vocab_size // 8) * 8
    cfg.update(vocab_size=padded, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
               pad_token_id=eos_token_id if pad_token_id is None else pad_token_id)
    return cfg


LLADA_MOE = Family(
    model_type="llada",
    config_from_hf=moe_config_from_hf,
    name_map=qwen_name_map(qk_norm=True, moe=True) + [
        (f"layers.{{i}}.mlp.shared.{p}.weight", f"model.layers.{{i}}.shared_expert.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")
    ],
    tiny_config=moe_tiny_config,
    # LLaDA2's tokenizer (docs/families/llada_moe.md)
    default_token_ids=LING_TOKEN_IDS,
)
# selectable by name for from-scratch configs (`model.family: llada_moe`); loading a checkpoint
# reaches it through the "llada" model_type and `_moe_variant`
FAMILIES.register("llada_moe")(LLADA_MOE)
