"""LLaDA2.x family (LLaDA2.0-mini, LLaDA2.1-mini; BailingMoeV2 lineage): fused query_key_value,
per-head q/k RMSNorm, partial RoPE, the first `first_k_dense_replace` layers dense and the rest
sigmoid-routed, group-limited MoE with an expert bias (selection only), routed scaling and one
shared expert; block diffusion with block size 32, unshifted logits. See docs/families/llada2.md."""
from __future__ import annotations

from dare_core.models.family import Family, register_family
from dare_core.models.transformer import MoEConfig, TransformerConfig

# <|mask|> and <|endoftext|> of the Ling tokenizer that LLaDA2 and LLaDA-MoE share
LING_TOKEN_IDS = {"mask": 156895, "eos": 156892}

# config fields whose other values our stack does not compute
_REQUIRED = {"use_qkv_bias": False, "use_bias": False, "use_qk_norm": True, "tie_word_embeddings": False}


def config_from_hf(cfg: dict) -> TransformerConfig:
    for key, want in _REQUIRED.items():
        if key in cfg and cfg[key] != want:
            raise ValueError(f"llada2_moe config: {key}={cfg[key]!r} is not supported (expected {want!r})")
    if cfg.get("rope_scaling"):
        raise ValueError(f"llada2_moe config: rope_scaling={cfg['rope_scaling']!r} is not supported")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    moe = MoEConfig(
        n_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"], hidden=cfg["moe_intermediate_size"],
        router="sigmoid_grouped", norm_topk_prob=True, n_shared=cfg.get("num_shared_experts", 0),
        n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
        routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)), expert_bias=True,
    )
    return TransformerConfig(
        vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"], n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        mlp_hidden_size=cfg["intermediate_size"], max_sequence_length=cfg.get("max_position_embeddings", 32768),
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        head_size=head_dim, qk_norm=True, fused_qkv=True,
        rotary_dim=int(head_dim * cfg.get("partial_rotary_factor", 1.0)), rope_fp32=False,
        moe=moe, moe_layers=tuple(range(cfg.get("first_k_dense_replace", 0), cfg["num_hidden_layers"])),
    )


def tiny_config(vocab_size: int, mask_token_id: int, eos_token_id: int, pad_token_id=None, **sizes) -> dict:
    cfg = {
        "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig", "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "hidden_act": "silu", "hidden_size": 128, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "intermediate_size": 256, "moe_intermediate_size": 32, "num_experts": 16,
        "num_experts_per_tok": 4, "num_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "partial_rotary_factor": 0.5, "rope_theta": 600000, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128, "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False,
        "tie_word_embeddings": False, "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        # (the released config.json has no block_size, its 32 is the family's; a from-scratch model may choose)
        "block_size": 32,
    }
    cfg.update(sizes)
    padded = -(-vocab_size // 8) * 8
    cfg.update(vocab_size=padded, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
               pad_token_id=eos_token_id if pad_token_id is None else pad_token_id)
    return cfg


_L = "model.layers.{i}"
LLADA2 = register_family(
    Family(
        model_type="llada2_moe",
        config_from_hf=config_from_hf,
        name_map=[
            ("embed.weight", "model.word_embeddings.weight"),
            ("layers.{i}.attn_norm.weight", f"{_L}.input_layernorm.weight"),
            ("layers.{i}.attn.qkv_proj.weight", f"{_L}.attention.query_key_value.weight"),
            ("layers.{i}.attn.q_norm.weight", f"{_L}.attention.query_layernorm.weight"),
            ("layers.{i}.attn.k_norm.weight", f"{_L}.attention.key_layernorm.weight"),
            ("layers.{i}.attn.o_proj.weight", f"{_L}.attention.dense.weight"),
            ("layers.{i}.mlp_norm.weight", f"{_L}.post_attention_layernorm.weight"),
            ("layers.{i}.mlp.gate_proj.weight", f"{_L}.mlp.gate_proj.weight"),
            ("layers.{i}.mlp.up_proj.weight", f"{_L}.mlp.up_proj.weight"),
            ("layers.{i}.mlp.down_proj.weight", f"{_L}.mlp.down_proj.weight"),
            ("layers.{i}.mlp.router.weight", f"{_L}.mlp.gate.weight"),
            ("layers.{i}.mlp.expert_bias", f"{_L}.mlp.gate.expert_bias"),
            ("layers.{i}.mlp.experts.{e}.gate_proj.weight", f"{_L}.mlp.experts.{{e}}.gate_proj.weight"),
            ("layers.{i}.mlp.experts.{e}.up_proj.weight", f"{_L}.mlp.experts.{{e}}.up_proj.weight"),
            ("layers.{i}.mlp.experts.{e}.down_proj.weight", f"{_L}.mlp.experts.{{e}}.down_proj.weight"),
            ("layers.{i}.mlp.shared.gate_proj.weight", f"{_L}.mlp.shared_experts.gate_proj.weight"),
            ("layers.{i}.mlp.shared.up_proj.weight", f"{_L}.mlp.shared_experts.up_proj.weight"),
            ("layers.{i}.mlp.shared.down_proj.weight", f"{_L}.mlp.shared_experts.down_proj.weight"),
            ("norm.weight", "model.norm.weight"),
            ("lm_head.weight", "lm_head.weight"),
        ],
        block_size=32,
        tiny_config=tiny_config,
        # config.json has neither (docs/families/llada2.md §5)
        default_token_ids=LING_TOKEN_IDS,
        # evaluated with low-confidence remasking in its blocks of 32
        sampler_defaults={"remasking": "low_confidence"},
        eval_label="LLaDA2",
    )
)
