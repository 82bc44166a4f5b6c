"""DiffusionGemma (google/diffusiongemma-26B-A4B-it): a uniform-noise block-diffusion model over the
Gemma-4 layer stack (gemma4.py). docs/families/diffusiongemma.md.

The released model is an encoder and a decoder with one set of weights: the encoder reads the
prompt (and every committed block) causally into a KV cache; the decoder denoises a canvas of
`canvas_length` tokens, attending to that cache and bidirectionally to the canvas, its input
embeddings conditioned on the previous step's logits (self-conditioning). Here both are one pass of
the stack over a sequence of clean (encoder) and noisy (decoder) tokens under `stream_masks`:
the canvas's logits are those of the decoder given the encoder's cache.

Only the text model is served: the checkpoint's vision tower is not loaded.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dare_core.models.family import Family, register_family
from dare_core.models.gemma4 import AttentionSpec, EncoderCache, Gemma4Config, Gemma4Stack, GemmaRMSNorm, gelu_tanh
from dare_core.models.transformer import SwiGLU

DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def layer_types(text: dict) -> list[str]:
    """Each layer's kind as the reference derives it: five sliding layers to one full one unless
    the config lists them, the last layer always full."""
    kinds = list(text.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                             for i in range(text["num_hidden_layers"])])
    kinds[-1] = "full_attention"
    return kinds


def config_from_hf(cfg: dict) -> Gemma4Config:
    """The stack's config from DiffusionGemma's config.json (its text_config)."""
    text = cfg["text_config"]
    if text.get("use_bidirectional_attention") == "all":
        raise ValueError("DiffusionGemma with a bidirectional encoder (use_bidirectional_attention: all) is not supported")
    rope = text.get("rope_parameters") or DEFAULT_ROPE
    # a saved config names each full layer's own head width (and key/value heads where they differ)
    # in per_layer_config; a hand-written one may give global_head_dim / num_global_key_value_heads
    per_layer = {int(i): v for i, v in (text.get("per_layer_config") or {}).items()}
    specs = []
    for i, kind in enumerate(layer_types(text)):
        full = kind == "full_attention"
        r = rope[kind]
        if r.get("rope_type", "default") not in ("default", "proportional") or r.get("factor", 1.0) != 1.0:
            raise ValueError(f"DiffusionGemma: RoPE {r} of the {kind} layers is not supported")
        own = per_layer.get(i, {}) if per_layer else ({"head_dim": text.get("global_head_dim", 512)} | (
            {"num_key_value_heads": text["num_global_key_value_heads"]} if text.get("num_global_key_value_heads") else {})
            if full else {})
        specs.append(AttentionSpec(
            sliding=not full, head_dim=own.get("head_dim", text["head_dim"]),
            n_kv_heads=own.get("num_key_value_heads", text["num_key_value_heads"]),
            keys_are_values=full,  # the reference's full layers have no value projection
            rope_theta=r["rope_theta"], rope_fraction=r.get("partial_rotary_factor", 1.0)))
    return Gemma4Config(
        vocab_size=text["vocab_size"], d_model=text["hidden_size"], n_layers=text["num_hidden_layers"],
        n_heads=text["num_attention_heads"], mlp_hidden_size=text["intermediate_size"], n_experts=text["num_experts"],
        top_k=text["top_k_experts"], expert_hidden=text["moe_intermediate_size"], layers=tuple(specs),
        sliding_window=text["sliding_window"], rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        final_logit_softcap=text.get("final_logit_softcapping", 30.0),
        max_sequence_length=text.get("max_position_embeddings", 262_144))


# (our name, checkpoint name); {i}: the layer. The encoder's weights are the decoder's (tied), its
# layer scalars its own; lm_head is the decoder's embedding (tied).
NAME_MAP = [
    ("embed.weight", "model.decoder.embed_tokens.weight"),
    ("norm.weight", "model.decoder.norm.weight"),
    ("layers.{i}.noisy_scalar", "model.decoder.layers.{i}.layer_scalar"),
    ("layers.{i}.clean_scalar", "model.encoder.language_model.layers.{i}.layer_scalar"),
    ("self_conditioning.pre_norm.weight", "model.decoder.self_conditioning.pre_norm.weight"),
    *((f"self_conditioning.mlp.{n}", f"model.decoder.self_conditioning.{n}") for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
    *((f"layers.{{i}}.attn.{n}", f"model.decoder.layers.{{i}}.self_attn.{n}") for n in (
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight")),
    *((f"layers.{{i}}.{n}", f"model.decoder.layers.{{i}}.{n}") for n in (
        "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight", "post_feedforward_layernorm_1.weight",
        "post_feedforward_layernorm_2.weight", "pre_feedforward_layernorm_2.weight", "router.proj.weight",
        "router.scale", "router.per_expert_scale", "experts.gate_up_proj", "experts.down_proj")),
]


class SelfConditioning(nn.Module):
    """The decoder's input: the canvas embeddings plus a gated MLP of the previous step's expected
    embeddings (zeros at the first step), normalised without a weight."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.pre_norm = GemmaRMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden_size, act=gelu_tanh)
        self.post_norm = GemmaRMSNorm(cfg.d_model, cfg.rms_norm_eps, with_weight=False)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        return self.post_norm(embeds + self.mlp(self.pre_norm(soft)))


class DiffusionGemmaNet(Gemma4Stack):
    """The Gemma 4 layers with the token embeddings (also the tied, soft-capped head) and the
    decoder's self-conditioning."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.self_conditioning = SelfConditioning(cfg)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Deterministic from-scratch init: matrices and expert stacks normal(0, std) (output
        projections scaled by depth), vectors (norm weights, router scales) and the layer scalars
        one; drawn in float32 on the generator's device and copied into place."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    out_proj = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
                    scale = std / (2 * self.cfg.n_layers) ** 0.5 if out_proj else std
                    draw = torch.randn(p.shape, generator=generator, dtype=torch.float32, device=generator.device)
                    p.copy_(draw.mul_(scale))
            for b in self.buffers():  # the layer scalars
                b.fill_(1.0)

    def embed_scale(self) -> torch.Tensor:
        # sqrt(d) rounded to the weights' dtype first, as the reference does (55.5 for 55.43 in bf16)
        return torch.tensor(self.cfg.d_model**0.5, dtype=self.embed.weight.dtype)

    def token_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) * self.embed_scale()

    def canvas_embeddings(self, canvas: torch.Tensor, previous_logits: Optional[torch.Tensor] = None,
                          use_previous: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoder's input embeddings of canvas tokens [B, C]; `previous_logits` [B, C, V] the last
        step's (None: the first step), `use_previous` [B] which rows take them (the others: none)."""
        embeds = self.token_embeddings(canvas)
        if previous_logits is None:
            soft = torch.zeros_like(embeds)
        else:
            probs = previous_logits.softmax(dim=-1, dtype=torch.float32).to(self.embed.weight.dtype)
            soft = (probs @ self.embed.weight) * self.embed_scale().to(embeds.dtype)
            if use_previous is not None:
                soft = soft * use_previous.to(soft.dtype)[:, None, None]
        return self.self_conditioning(embeds, soft)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states, soft-capped as the reference does."""
        logits = F.linear(hidden, self.embed.weight).float()
        cap = self.cfg.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def forward(self, ids: torch.Tensor, clean: torch.Tensor, position_ids: torch.Tensor, block_start: torch.Tensor,
                previous_logits: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                use_previous: Optional[torch.Tensor] = None, cache: Optional[EncoderCache] = None,
                write: bool = False) -> torch.Tensor:
        """Final hidden states [B, S, d] of a sequence of clean tokens (clean [B, S] True) and noisy
        ones (as many in every row), each denoised within the block starting at its `block_start`
        position; `previous_logits` [B, N, V] the self-conditioning logits of the N noisy tokens of
        each row (in order), `use_previous` [B] the rows that take them. With `cache`, the keys are
        the cached clean tokens' and then these; `write` appends these (all clean) to the cache."""
        x = self.token_embeddings(ids)
        noisy = ~clean
        if noisy.any():
            b = ids.shape[0]
            prev = None if previous_logits is None else previous_logits.reshape(b, -1, previous_logits.shape[-1])
            canvas = self.canvas_embeddings(ids[noisy].view(b, -1), prev, use_previous)
            x = x.masked_scatter(noisy[..., None], canvas)
        keys, key_mask = None, attention_mask
        if cache is not None and cache.positions is not None:
            ones = torch.ones_like(cache.positions, dtype=torch.bool)
            keys = (torch.cat([cache.positions, position_ids], 1), torch.cat([ones, clean], 1),
                    torch.cat([torch.zeros_like(cache.positions), block_start], 1))
            own = attention_mask if attention_mask is not None else torch.ones_like(ids)
            key_mask = torch.cat([cache.attention_mask, own], 1)
        masks = {sliding: stream_masks(position_ids, clean, block_start, self.cfg.sliding_window if sliding else None,
                                       key_mask, keys) for sliding in {s.sliding for s in self.cfg.layers}}
        return self.run_layers(x, position_ids, masks, clean, cache, write)

    def encode(self, cache: EncoderCache, ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Append clean tokens [B, W] (the prompt, then each committed block) to the encoder's cache."""
        clean = torch.ones_like(ids, dtype=torch.bool)
        self(ids, clean, position_ids, torch.zeros_like(ids), attention_mask=attention_mask, cache=cache, write=True)
        cache.append_tokens(position_ids, attention_mask)

    def decode(self, cache: EncoderCache, canvas: torch.Tensor, position_ids: torch.Tensor,
               previous_logits: Optional[torch.Tensor] = None, use_previous: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, C, V] of the decoder over a canvas [B, C] at `position_ids` after the cache."""
        noisy = torch.zeros_like(canvas, dtype=torch.bool)
        start = position_ids[:, :1].expand_as(position_ids)
        return self.logits(self(canvas, noisy, position_ids, start, previous_logits, use_previous=use_previous, cache=cache))

    def canvas_logits(self, prompt: torch.Tensor, canvas: torch.Tensor, previous_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B, C, V] logits of the decoder over `canvas` [B, C] after the prompt [B, P] (no padding):
        what the reference's forward(input_ids=prompt, decoder_input_ids=canvas) returns."""
        b, p = prompt.shape
        c = canvas.shape[1]
        ids = torch.cat([prompt, canvas], dim=1)
        clean = torch.zeros_like(ids, dtype=torch.bool)
        clean[:, :p] = True
        pos = torch.arange(p + c, device=ids.device).expand(b, -1)
        start = torch.full_like(ids, p)
        return self.logits(self(ids, clean, pos, start, previous_logits)[:, p:])


def stream_masks(pos: torch.Tensor, clean: torch.Tensor, block_start: torch.Tensor, window: Optional[int],
                 attention_mask: Optional[torch.Tensor] = None, keys: Optional[tuple] = None) -> torch.Tensor:
    """[B, 1, S, S] boolean: what each token sees, as encoder and decoder see it in the reference.
    A clean token: clean tokens at its position or before (the last `window` of them on a sliding
    layer). A noisy token: clean tokens before its block (the last window - 1 of them on a sliding
    layer: the encoder cache keeps no more) and the noisy tokens of its own block. `keys`: (pos,
    clean, block_start) of other keys than the queries (a window over an `EncoderCache`: [B, 1, S, K])."""
    kpos, kclean, kstart = keys if keys is not None else (pos, clean, block_start)
    pq, pk = pos[:, :, None], kpos[:, None, :]
    cq, ck = clean[:, :, None], kclean[:, None, :]
    sq, sk = block_start[:, :, None], kstart[:, None, :]
    clean_sees = ck & (pk <= pq)
    noisy_sees = (ck & (pk < sq)) | (~ck & (sk == sq))
    if window is not None:
        clean_sees &= pq - pk < window
        noisy_sees &= ~ck | (pk >= sq - (window - 1))
    mask = torch.where(cq, clean_sees, noisy_sees)
    if attention_mask is not None:
        mask &= attention_mask.bool()[:, None, :]
    return mask[:, None]


# checkpoint tensors DARE does not load: the vision tower and its embedder (DARE serves the text
# model), and the encoder's copies of the decoder's weights (tied; its layer scalars are its own)
IGNORED = re.compile(r"model\.encoder\.(vision_tower|embed_vision)\.|model\.encoder\.language_model\.(?!layers\.\d+\.layer_scalar$)")


def tiny_config(vocab_size: int, mask_token_id: Optional[int] = None, eos_token_id: int = 1, pad_token_id: Optional[int] = 0,
                canvas_length: int = 8, **sizes) -> dict:
    """config.json of a small DiffusionGemma in the reference's layout (text only). `mask_token_id`
    is ignored (the family has none); `sizes` are text_config keys."""
    text = {"model_type": "diffusion_gemma_text", "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "global_head_dim": 32, "num_global_key_value_heads": 1, "sliding_window": 6,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "num_experts": 4,
            "top_k_experts": 2, "moe_intermediate_size": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "rope_parameters": DEFAULT_ROPE,
            "eos_token_id": eos_token_id, "pad_token_id": eos_token_id if pad_token_id is None else pad_token_id, "bos_token_id": 2, "tie_word_embeddings": True,
            **sizes}
    return {"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"], "text_config": text,
            "canvas_length": canvas_length, "tie_word_embeddings": True}


FAMILY = register_family(Family(
    model_type="diffusion_gemma", config_from_hf=config_from_hf, name_map=NAME_MAP, network=DiffusionGemmaNet,
    noise="uniform", ignored=IGNORED, block_size=256, block_size_key="canvas_length", blocks_at_prompt_end=True,
    tiny_config=tiny_config, token_id_keys={"eos": "text_config.eos_token_id", "pad": "text_config.pad_token_id"},
    # the reference's generation defaults (transformers' DiffusionGemmaGenerationConfig; its 48 steps
    # a canvas are `steps` = 48 x gen_length / canvas_length here)
    sampler_defaults={"unmasking": "entropy_bound_renoise", "entropy_bound": 0.1, "temperature": 0.8, "temperature_min": 0.4,
                      "stable_steps": 1, "stop_entropy": 0.005, "cache": "block_kv"},
    eval_label="DiffusionGemma",
))
