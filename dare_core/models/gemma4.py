"""The Gemma-4 layer stack that DiffusionGemma's encoder and decoder share (docs/families/diffusiongemma.md).

What sets it apart from the shared transformer (transformer.py), all of it per layer:
- two kinds of attention layer: sliding-window ones (their own head width and key/value heads, RoPE
  over the whole head) and full ones (wider heads, keys that are also the values, RoPE over a
  fraction of each head's frequencies, "proportional": the rest rotate by zero);
- RMSNorm on queries, keys and values (the values' without a weight), and no 1/sqrt(d) scaling;
- "sandwich" norms around attention and the feed-forward part, which is a dense GELU MLP and a
  routed mixture of experts side by side, each with its own norms, summed;
- a per-layer output scalar (a buffer of the checkpoint).

The stack runs one sequence whose tokens may belong to two streams with the same weights: clean
tokens (the encoder's: prompt and committed blocks) and noisy ones (the decoder's canvas). They
differ only in their layer scalars and in what the attention mask lets them see.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dare_core.models.attention import attend
from dare_core.models.transformer import SwiGLU, apply_rope, expert_groups


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's shape and position encoding."""

    sliding: bool  # a sliding-window layer (else full attention)
    head_dim: int
    n_kv_heads: int
    keys_are_values: bool  # no value projection: the values are the key projection (before its norm)
    rope_theta: float
    rope_fraction: float  # the share of the head's frequencies that rotate (the rest rotate by 0)


@dataclass
class Gemma4Config:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden_size: int
    n_experts: int
    top_k: int
    expert_hidden: int
    layers: tuple  # AttentionSpec per layer
    sliding_window: int
    rms_norm_eps: float = 1e-6
    final_logit_softcap: Optional[float] = 30.0
    max_sequence_length: int = 262_144
    # the head reads the embedding table itself: there is no lm_head module to tie or to export
    tie_embeddings: bool = False


def rms_normalize(x: torch.Tensor, eps: float, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 in float32, times the weight in float32 when there is one, cast back
    (the shared RMSNorm casts back before its weight, as Llama and Qwen do: other bf16 roundings)."""
    x32 = x.float()
    out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_weight: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.eps, self.weight)


def inverse_frequencies(spec: AttentionSpec) -> torch.Tensor:
    """[head_dim / 2] RoPE frequencies: theta^(-2k / head_dim) for the rotating share, zeros after it."""
    half = spec.head_dim // 2
    rotating = int(spec.rope_fraction * spec.head_dim // 2)
    freqs = 1.0 / (spec.rope_theta ** (torch.arange(0, 2 * rotating, 2, dtype=torch.int64).float() / spec.head_dim))
    return torch.cat([freqs, torch.zeros(half - rotating)])


def rope_tables(position_ids: torch.Tensor, spec: AttentionSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, head_dim] of the half-split rotation, in the activation dtype."""
    freqs = position_ids.float()[..., None] * inverse_frequencies(spec).to(position_ids.device)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, spec: AttentionSpec):
        super().__init__()
        self.spec, self.n_heads = spec, cfg.n_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, spec.n_kv_heads * spec.head_dim, bias=False)
        self.v_proj = None if spec.keys_are_values else nn.Linear(cfg.d_model, spec.n_kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * spec.head_dim, cfg.d_model, bias=False)
        self.q_norm = GemmaRMSNorm(spec.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(spec.head_dim, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cached: Optional["CachedKeys"] = None) -> torch.Tensor:
        b, s, _ = x.shape
        d, kv = self.spec.head_dim, self.spec.n_kv_heads
        q = self.q_norm(self.q_proj(x).view(b, s, self.n_heads, d)).transpose(1, 2)
        k_raw = self.k_proj(x).view(b, s, kv, d)
        v = k_raw if self.v_proj is None else self.v_proj(x).view(b, s, kv, d)
        k = self.k_norm(k_raw).transpose(1, 2)
        v = rms_normalize(v, self.eps).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, in_fp32=False), apply_rope(k, cos, sin, in_fp32=False)
        if cached is not None:  # the encoder's keys and values before this window's
            k, v = cached.extend(k, v)
        # Gemma 4 normalises q and k and does not scale their product; every attention backend divides by sqrt(d)
        out = attend(q * d**0.5, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma4Router(nn.Module):
    """Softmax over experts of the weight-free-normalised, scaled input; top-k renormalised, then
    each chosen expert's weight times its own learned scale."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.top_k, self.eps = cfg.top_k, cfg.rms_norm_eps
        self.proj = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.d_model))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (expert indices [T, k], weights [T, k])."""
        h = rms_normalize(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, idx = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights * self.per_expert_scale[idx]


class Gemma4Experts(nn.Module):
    """The routed experts as two stacked tensors, as the checkpoint stores them: gate and up
    projections [E, 2 * hidden, d] (gate rows first), down projections [E, d, hidden]."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.expert_hidden, cfg.d_model))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.expert_hidden))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, token, slot in expert_groups(idx, self.gate_up_proj.shape[0]):
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(gelu_tanh(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class Gemma4Layer(nn.Module):
    def __init__(self, cfg: Gemma4Config, spec: AttentionSpec):
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.d_model, cfg.rms_norm_eps)  # noqa: E731
        self.attn = Gemma4Attention(cfg, spec)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden_size, act=gelu_tanh)
        self.post_feedforward_layernorm_1 = norm()
        self.router = Gemma4Router(cfg)
        self.experts = Gemma4Experts(cfg)
        self.pre_feedforward_layernorm_2, self.post_feedforward_layernorm_2 = norm(), norm()
        # the output scalar of each stream: the checkpoint stores the encoder's and the decoder's apart
        self.register_buffer("clean_scalar", torch.ones(1))
        self.register_buffer("noisy_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                clean: torch.Tensor, cached: Optional["CachedKeys"] = None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.attn(self.input_layernorm(x), cos, sin, mask, cached))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.router(flat)
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), idx, weights)
        routed = self.post_feedforward_layernorm_2(routed.view_as(x))
        x = x + self.post_feedforward_layernorm(dense + routed)
        return x * torch.where(clean[..., None], self.clean_scalar, self.noisy_scalar).to(x.dtype)


class Gemma4Stack(nn.Module):
    """The layers and the final norm (`layers.{i}`, `norm`: the generic module tree LoRA targets
    match); `run_layers` takes embeddings and one boolean mask per attention kind."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Gemma4Layer(cfg, spec) for spec in cfg.layers)
        self.norm = GemmaRMSNorm(cfg.d_model, cfg.rms_norm_eps)
        # training keeps one layer's activations at a time and recomputes the rest in backward
        # (`DiffusionLM.set_gradient_checkpointing`, model.gradient_checkpointing)
        self.gradient_checkpointing = False

    def run_layers(self, x: torch.Tensor, position_ids: torch.Tensor, masks: dict, clean: torch.Tensor,
                   cache: Optional["EncoderCache"] = None, write: bool = False) -> torch.Tensor:
        """x [B, S, d] embeddings; masks {True: sliding layers' [B, 1, S, keys], False: full layers'};
        clean [B, S] which tokens are the encoder's. With `cache` the keys are the cached tokens' and
        then this window's, and `write` appends the window's to the cache. Final-norm hidden states."""
        tables = {}
        for i, layer in enumerate(self.layers):
            spec = layer.attn.spec
            if spec not in tables:
                tables[spec] = rope_tables(position_ids, spec, x.dtype)
            cached = CachedKeys(cache, i, write) if cache is not None else None
            if self.gradient_checkpointing and cached is None and torch.is_grad_enabled():
                x = checkpoint(layer, x, *tables[spec], masks[spec.sliding], clean, use_reentrant=False)
            else:
                x = layer(x, *tables[spec], masks[spec.sliding], clean, cached)
        return self.norm(x)


class EncoderCache:
    """The encoder's keys and values of every clean token so far, per layer, with those tokens'
    positions and padding: what the decoder reads and the next block's encoding appends to."""

    def __init__(self, n_layers: int):
        self.k: list = [None] * n_layers
        self.v: list = [None] * n_layers
        self.positions: Optional[torch.Tensor] = None  # [B, L]
        self.attention_mask: Optional[torch.Tensor] = None  # [B, L]

    def append_tokens(self, positions: torch.Tensor, attention_mask: torch.Tensor) -> None:
        cat = lambda old, new: new if old is None else torch.cat([old, new], dim=1)  # noqa: E731
        self.positions, self.attention_mask = cat(self.positions, positions), cat(self.attention_mask, attention_mask)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished sequences leave the batch)."""
        self.k = [k[rows] if k is not None else None for k in self.k]
        self.v = [v[rows] if v is not None else None for v in self.v]
        self.positions, self.attention_mask = self.positions[rows], self.attention_mask[rows]


class CachedKeys:
    """One layer's view of an `EncoderCache` during a forward."""

    def __init__(self, cache: EncoderCache, layer: int, write: bool):
        self.cache, self.layer, self.write = cache, layer, write

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.cache.k[self.layer], self.cache.v[self.layer]
        full_k = k if old_k is None else torch.cat([old_k, k], dim=2)
        full_v = v if old_v is None else torch.cat([old_v, v], dim=2)
        if self.write:
            self.cache.k[self.layer], self.cache.v[self.layer] = full_k, full_v
        return full_k, full_v
