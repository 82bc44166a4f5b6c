"""A tiny DiffusionGemma built by transformers' reference code (text config in DARE's tiny layout, a
small vision tower beside it), every 1-D weight and every layer scalar drawn away from its init so
that one read from the wrong place shows, saved as the reference saves it."""
from pathlib import Path

import torch

from dare_core.diffusion.seeding import generator
from dare_core.models.diffusion_gemma import tiny_config

VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}


def reference_model(vocab: int = 64, eos: int = 1, canvas_length: int = 8, seed: int = 1, embed_scale: float = 1.0, **sizes):
    """`embed_scale` multiplies the (tied) embedding table: at init its logits are almost flat, and a
    larger table gives a model confident enough for the sampler's early stop."""
    import transformers

    cfg = tiny_config(vocab, eos_token_id=eos, canvas_length=canvas_length, **sizes)
    hf_cfg = transformers.DiffusionGemmaConfig(text_config=cfg["text_config"], vision_config=VISION, canvas_length=canvas_length)
    hf_cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.DiffusionGemmaForBlockDiffusion(hf_cfg).eval()
    g = generator(seed, "diffusion-gemma-weights")
    with torch.no_grad():
        for _, p in ref.named_parameters():
            if p.dim() == 1:  # norms, router scales: all ones at init
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in ref.named_buffers():
            if name.endswith("layer_scalar"):  # the encoder's and the decoder's drawn apart
                b.copy_(1 + 0.3 * torch.randn(b.shape, generator=g))
        ref.model.decoder.embed_tokens.weight.mul_(embed_scale)
    return ref


def saved_reference(folder: Path, **kwargs):
    """(reference model, the folder it saved itself to)."""
    ref = reference_model(**kwargs)
    ref.save_pretrained(folder)
    return ref, folder
