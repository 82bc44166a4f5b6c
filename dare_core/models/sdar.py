"""SDAR family (SDAR-1.7B/4B/8B-Chat, SDAR-30B-A3B-Chat): Qwen3 layout with per-head q/k RMSNorm,
block diffusion (block-causal attention, block size 4 unless the config says otherwise),
unshifted logits; the 30B-A3B checkpoint is the Qwen3-MoE layout (softmax top-k routing, every
layer sparse). See docs/families/sdar.md."""
from __future__ import annotations

from dare_core.models.family import Family, register_family
from dare_core.models.qwen import qwen_config, qwen_name_map
from dare_core.models.transformer import MoEConfig


def _moe_layers(cfg: dict) -> tuple:
    """Qwen3-MoE's rule: a layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step."""
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def dense_config(cfg: dict):
    return qwen_config(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)


def moe_config(cfg: dict):
    moe = MoEConfig(
        n_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"], hidden=cfg["moe_intermediate_size"],
        router="softmax", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
    )
    return qwen_config(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True, moe=moe, moe_layers=_moe_layers(cfg))


def tiny_config(vocab_size: int, mask_token_id: int, eos_token_id: int, pad_token_id=None, moe: bool = False, **sizes) -> dict:
    cfg = {
        "model_type": "sdar_moe" if moe else "sdar",
        "architectures": ["SDARMoeForCausalLM" if moe else "SDARForCausalLM"],
        "hidden_act": "silu", "hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4, "head_dim": 32,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False,
        "block_size": 4,
    }
    if moe:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
    cfg.update(sizes)
    padded = -(-vocab_size // 8) * 8
    cfg.update(vocab_size=padded, mask_token_id=mask_token_id, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
               pad_token_id=eos_token_id if pad_token_id is None else pad_token_id)
    return cfg


# <|MASK|> and <|endoftext|> of the SDAR tokenizer (added_tokens.json); SDAR-30B-A3B's config.json
# has no mask_token_id (docs/families/sdar.md)
TOKEN_IDS = {"mask": 151669, "eos": 151643}
# what both layouts share beyond the weights: evaluated with low-confidence remasking in the model's
# own blocks (4), decodable by lmdeploy, and a Qwen2 byte-level BPE tokenizer whose class says SDAR
SHARED = dict(block_size=4, default_token_ids=TOKEN_IDS, sampler_defaults={"remasking": "low_confidence"}, eval_label="SDAR",
              engines=("lmdeploy",), tokenizer_class_words=("SDAR",))
SDAR = register_family(Family(model_type="sdar", config_from_hf=dense_config, name_map=qwen_name_map(qk_norm=True),
                              tiny_config=tiny_config, **SHARED))
SDAR_MOE = register_family(Family(model_type="sdar_moe", config_from_hf=moe_config, name_map=qwen_name_map(qk_norm=True, moe=True),
                                  tiny_config=lambda *a, **k: tiny_config(*a, moe=True, **k), **SHARED))
