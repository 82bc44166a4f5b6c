"""Logit parity with the published reference implementations of each layout, on tiny random weights
in float32: our Dream equals transformers' Qwen2 (Dream's code is Qwen2 with a bidirectional mask),
SDAR equals Qwen3 / Qwen3-MoE under SDAR's block-causal mask, LLaDA equals Llama with a bidirectional
mask. The transformers models load the folders our `save_model` writes, in the real on-disk layout."""
import json

import pytest
import torch

from dare_core.diffusion.seeding import generator
from dare_core.models.hf_folder import save_model
from dare_core.models.lm import block_causal_mask
from tiny_models import tiny

transformers = pytest.importorskip("transformers")


def _reference(folder, config_cls, model_cls, **overrides):
    cfg = json.loads((folder / "config.json").read_text())
    keep = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map", "torch_dtype")}
    config = config_cls(**{**keep, **overrides})
    config._attn_implementation = "sdpa"
    return model_cls.from_pretrained(folder, config=config, torch_dtype=torch.float32).eval()


def _inputs(n=12):
    return torch.randint(0, 60, (2, n), generator=generator(9, "oracle"))


def test_dream_matches_qwen2_bidirectional(tmp_path):
    ours = tiny("Dream")
    folder = save_model(ours, tmp_path / "dream")
    ref = _reference(folder, transformers.Qwen2Config, transformers.Qwen2ForCausalLM)
    x = _inputs()
    full = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    with torch.no_grad():
        expected = ref(x, attention_mask=full).logits
        raw = ours.net(x)
        aligned = ours(x)
    torch.testing.assert_close(raw, expected, atol=2e-5, rtol=1e-4)
    # Dream's generation reads position i's logits from output i-1
    torch.testing.assert_close(aligned[:, 1:], expected[:, :-1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe"])
def test_sdar_matches_qwen3_under_the_block_causal_mask(tmp_path, model_type):
    ours = tiny(model_type)
    folder = save_model(ours, tmp_path / model_type)
    if model_type == "sdar":
        ref = _reference(folder, transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
    else:
        ref = _reference(folder, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)
    x = _inputs()
    pos = torch.arange(12).expand(2, -1)
    mask = block_causal_mask(pos, ours.block_size)
    with torch.no_grad():
        expected = ref(x, attention_mask=mask).logits
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_llada_matches_llama_bidirectional():
    ours = tiny("llada")
    c = ours.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.mlp_hidden_size, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_sequence_length, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    config._attn_implementation = "sdpa"
    ref = transformers.LlamaForCausalLM(config).eval()
    rename = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
    state = {}
    for k, v in ours.net.state_dict().items():
        if k in rename:
            state[rename[k]] = v
        else:
            k = k.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm").replace(".attn.", ".self_attn.")
            state["model." + k] = v
    ref.load_state_dict(state, strict=True)
    x = _inputs()
    with torch.no_grad():
        expected = ref(x, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool)).logits
    torch.testing.assert_close(ours(x), expected, atol=2e-5, rtol=1e-4)


def test_llada_moe_matches_qwen3_moe_bidirectional_without_renormalisation(tmp_path):
    """LLaDA-MoE's math is Qwen3-MoE's (per-head q/k norm, softmax top-k) with norm_topk_prob off and
    bidirectional attention; its checkpoint names are the same Llama/OLMoE layout."""
    ours = tiny("llada_moe")
    assert ours.family.model_type == "llada" and ours.config.moe.norm_topk_prob is False
    folder = save_model(ours, tmp_path / "llada_moe")
    cfg = json.loads((folder / "config.json").read_text())
    ref = _reference(folder, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                     moe_intermediate_size=cfg["expert_intermediate_size"], intermediate_size=cfg["dense_intermediate_size"],
                     norm_topk_prob=False, head_dim=cfg["hidden_size"] // cfg["num_attention_heads"], decoder_sparse_step=1, mlp_only_layers=[])
    x = _inputs()
    with torch.no_grad():
        expected = ref(x, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool)).logits
    torch.testing.assert_close(ours(x), expected, atol=2e-5, rtol=1e-4)
