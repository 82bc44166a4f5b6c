"""Tiny random models of every family, for tests."""
import torch

from dare_core.diffusion.seeding import generator
from dare_core.models.family import get_family
from dare_core.models.lm import build_model

VOCAB, MASK, EOS = 64, 63, 62
FAMILIES = ["llada", "llada_moe", "Dream", "sdar", "sdar_moe", "llada2_moe"]
# families without a mask token (uniform noise): their own tests, not the masked ones' loops over FAMILIES
UNIFORM_FAMILIES = ["diffusion_gemma"]
SMALL = {
    # head width 16: FlexAttention's compiled kernels need at least 16 (the GPU backend tests use these too)
    "llada": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden_size": 64, "max_sequence_length": 64},
    "llada_moe": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                  "expert_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2},
    "Dream": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64},
    "sdar": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64},
    "sdar_moe": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "llada2_moe": {"hidden_size": 32, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
                   "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2},
    # three layers (one full), four experts, canvases of 8 (diffusion_gemma.tiny_config)
    "diffusion_gemma": {},
}


# head width 64 for GPU training tests. Open: on an H100 (torch 2.11) the compiled FlexAttention
# backward found no kernel (NoValidChoicesError) for these tiny packed batches at width 16 and at 64
# alike, while it trains SDAR-8B (bench/results/gpu_tests.md, train_step.md)
WIDE_HEADS = {
    "llada": {"d_model": 128, "n_heads": 2, "n_kv_heads": 1},
    "Dream": {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
    "sdar": {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64},
    "llada2_moe": {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64},
}


def tiny(model_type: str, seed: int = 0, wide_heads: bool = False, vocab: int = VOCAB):
    sizes = {**SMALL[model_type], **(WIDE_HEADS[model_type] if wide_heads else {})}
    cfg = get_family(model_type).tiny_config(vocab, MASK, EOS, **sizes)
    model = build_model(cfg)
    model.net.init_weights(generator(seed, model_type), std=0.3)
    for layer in model.net.layers:  # a non-trivial selection-only bias
        if hasattr(layer.mlp, "expert_bias"):
            layer.mlp.expert_bias.copy_(torch.randn(layer.mlp.expert_bias.shape, generator=generator(seed, "bias")) * 0.1)
    return model.eval()
