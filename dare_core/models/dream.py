"""Dream family (Dream-v0-Base/Instruct-7B): Qwen2 layout with q/k/v biases, bidirectional
attention, and shifted logits (position i's prediction is output i-1, kept from its AR origin).
See docs/families/dream.md."""
from __future__ import annotations

from dare_core.models.family import Family, register_family
from dare_core.models.qwen import qwen_config, qwen_name_map


def config_from_hf(cfg: dict):
    # Dream's attention always has q/k/v biases (not a config field) and no q/k norm
    return qwen_config(cfg, qkv_bias=True, qk_norm=False)


def tiny_config(vocab_size: int, mask_token_id: int, eos_token_id: int, pad_token_id=None, **sizes) -> dict:
    cfg = {
        "model_type": "Dream", "architectures": ["DreamModel"],
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "hidden_act": "silu", "hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
    }
    cfg.update(sizes)
    padded = -(-vocab_size // 8) * 8
    cfg.update(vocab_size=padded, mask_token_id=mask_token_id, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
               pad_token_id=eos_token_id if pad_token_id is None else pad_token_id)
    return cfg


DREAM = register_family(
    Family(
        model_type="Dream",
        config_from_hf=config_from_hf,
        name_map=qwen_name_map(qkv_bias=True),
        shift_logits=True,
        tiny_config=tiny_config,
        # Dream-v0's config.json: <|mask|>, <|endoftext|>
        default_token_ids={"mask": 151666, "eos": 151643},
        # evaluated with Dream's timestep schedule and entropy confidence
        sampler_defaults={"schedule": "dream", "remasking": "entropy"},
        eval_label="Dream",
        tokenizer_class_words=("Dream",),
    )
)
