"""One decoder stack for every family: RMSNorm, RoPE, attention, SwiGLU MLP or mixture of experts.

It knows nothing about any family: a family file maps its config.json onto `TransformerConfig`,
maps its weight names onto this module tree, and chooses the attention pattern.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dare_core.models.attention import attend, key_padding_mask
from dare_core.models.compiled import LazyCompiled
from dare_core.models.shapes import check_shapes


@dataclass
class MoEConfig:
    n_experts: int
    top_k: int
    hidden: int  # intermediate size of one routed expert
    # softmax: softmax over all experts, top-k (Qwen3-MoE / SDAR-MoE, LLaDA-MoE)
    # sigmoid_grouped: sigmoid scores, selection biased by `expert_bias`, group-limited top-k (LLaDA2)
    router: str = "softmax"
    norm_topk_prob: bool = True
    n_shared: int = 0  # shared experts, fused into one SwiGLU of width hidden * n_shared
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    expert_bias: bool = False


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden_size: int
    max_sequence_length: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_size: Optional[int] = None  # explicit head width when it is not d_model / n_heads
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE
    fused_qkv: bool = False  # one projection whose rows are [all q heads; all k heads; all v heads]
    rotary_dim: Optional[int] = None  # rotate only the first rotary_dim dims of a head (partial RoPE)
    # True: rotate in float32 (LLaDA); False: cos/sin cast to the activation dtype first (Qwen lineage)
    rope_fp32: bool = True
    moe: Optional[MoEConfig] = None
    moe_layers: tuple = field(default_factory=tuple)  # indices of the layers whose MLP is the MoE

    def __post_init__(self) -> None:
        check_shapes(self)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 whatever the model dtype; the weight multiplies after the cast back
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, S, rotary_dim] for the half-split ("rotate_half") RoPE, computed in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=position_ids.device, dtype=torch.int64).float() / rotary_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, S, rotary_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, in_fp32: bool = True) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of every head; the rest pass through (partial RoPE)."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    if in_fp32:
        r = rot.float()
    else:
        r, cos, sin = rot, cos.to(x.dtype), sin.to(x.dtype)
    r1, r2 = r.chunk(2, dim=-1)
    out = (r * cos + torch.cat([-r2, r1], dim=-1) * sin).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        if cfg.fused_qkv:
            self.qkv_proj = nn.Linear(cfg.d_model, q_out + 2 * kv_out, bias=cfg.qkv_bias)
        else:
            self.q_proj = nn.Linear(cfg.d_model, q_out, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(cfg.d_model, kv_out, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(cfg.d_model, kv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_out, cfg.d_model, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                cache: Optional["LayerCache"] = None) -> torch.Tensor:
        b, s, _ = x.shape
        if self.cfg.fused_qkv:
            q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin, self.cfg.rope_fp32), apply_rope(k, cos, sin, self.cfg.rope_fp32)
        if cache is not None:  # write this window's keys/values, then attend to the cache's first key_end columns
            k, v = cache.write_and_read(k, v)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SiLU unless `act` says otherwise (Gemma's tanh GELU)."""

    def __init__(self, d_model: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def expert_groups(idx: torch.Tensor, n_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, tokens, slots) of each expert that routing `idx` [T, k] chose, experts ascending and
    each one's assignments in (token, slot) order: what `(idx == e).nonzero()` gives expert by expert,
    found with one copy of the counts to the host instead of a wait on the GPU per expert."""
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    k = idx.shape[-1]
    return [(e, part // k, part % k) for e, part in enumerate(order.split(counts)) if counts[e]]


class MoE(nn.Module):
    """Routed SwiGLU experts (+ optional shared expert). The router runs in float32."""

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(d_model, cfg.n_experts, bias=False)
        if cfg.expert_bias:
            # selection-only bias (LLaDA2): saved with the checkpoint, never trained by gradient
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.experts = nn.ModuleList(SwiGLU(d_model, cfg.hidden) for _ in range(cfg.n_experts))
        if cfg.n_shared:
            self.shared = SwiGLU(d_model, cfg.hidden * cfg.n_shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (expert indices [T, k], float32 weights [T, k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.router.weight.float())
        if cfg.router == "softmax":
            probs = logits.softmax(dim=-1)
            weights, idx = probs.topk(cfg.top_k, dim=-1)
            if cfg.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        elif cfg.router == "sigmoid_grouped":
            scores = logits.sigmoid()
            biased = scores + self.expert_bias.float() if cfg.expert_bias else scores
            groups = biased.view(-1, cfg.n_group, cfg.n_experts // cfg.n_group)
            group_score = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, 1.0)
            allowed = keep[..., None].expand_as(groups).reshape_as(biased).bool()
            idx = biased.masked_fill(~allowed, float("-inf")).topk(cfg.top_k, dim=-1).indices
            weights = scores.gather(-1, idx)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:
            raise ValueError(f"unknown MoE router '{cfg.router}'")
        return idx, weights * cfg.routed_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.route(flat)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        for e, token, slot in expert_groups(idx, self.cfg.n_experts):
            y = self.experts[e](flat[token]).float() * weights[token, slot, None]
            out.index_add_(0, token, y)
        out = out.to(x.dtype)
        if self.cfg.n_shared:
            out = out + self.shared(flat)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, moe: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.mlp = MoE(cfg.d_model, cfg.moe) if moe else SwiGLU(cfg.d_model, cfg.mlp_hidden_size)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Pre-norm decoder stack. `forward` returns logits; the attention pattern is the mask passed in."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        moe_layers = set(cfg.moe_layers) if cfg.moe is not None else set()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i in moe_layers) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.gradient_checkpointing = False
        # training forwards run each layer through torch.compile (`model.compile`); rollouts and
        # eval-mode scoring stay eager (CUDA-graph capture and KV-cache windows are their own path)
        self.compile_training = False

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Deterministic from-scratch init (normal(0, std), output projections scaled by depth) of
        every parameter and buffer, on whatever device and in whatever dtype they already are.

        Each weight is drawn in float32 on the generator's device, one tensor at a time, and copied
        into place (cast there). A CPU generator therefore gives the very values of a CPU float32
        init followed by a cast, on any device; a CUDA generator draws on the GPU, so a model
        allocated there never goes through the host (other values, as deterministic)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(0.0 if name.endswith("bias") else 1.0)
                else:
                    scale = std / (2 * self.cfg.n_layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                    draw = torch.randn(p.shape, generator=generator, dtype=torch.float32, device=generator.device)
                    p.copy_(draw.mul_(scale))
            # a model allocated empty (registry.empty_model) holds garbage here too: every buffer must
            # have a from-scratch value, and one that has none must not pass silently
            for name, b in self.named_buffers():
                if not name.endswith("expert_bias"):
                    raise ValueError(f"init_weights: no from-scratch value for buffer '{name}'")
                b.zero_()  # selection-only bias: starts neutral

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional["KVCache"] = None,
        compiled_layers: bool = False,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, S, d]. `attn_mask` (bool, broadcastable to [B,H,S,S]) overrides
        the default bidirectional key-padding mask built from `attention_mask`. With `kv_cache`, the
        input is a window of the cached sequence (its columns are `kv_cache.cols`) and `attn_mask`
        is [B, 1, S, key_end] over the cache's keys; `compiled_layers` runs each layer of such a
        window through one torch.compile'd layer call (the rollouts' `compile_forward`)."""
        if position_ids is None:
            position_ids = default_position_ids(input_ids, attention_mask)
        if attn_mask is None and attention_mask is not None:
            attn_mask = key_padding_mask(attention_mask)
        cos, sin = rope_cos_sin(position_ids, self.cfg.rotary_dim or self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed(input_ids)
        compiled = self.compile_training and self.training and kv_cache is None
        run = compiled_layer if compiled else _call_layer
        for i, layer in enumerate(self.layers):
            if self.gradient_checkpointing and self.training:
                x = checkpoint(run, layer, x, cos, sin, attn_mask, use_reentrant=False)
            elif compiled:
                x = run(layer, x, cos, sin, attn_mask)
            elif kv_cache is not None and compiled_layers:
                x = compiled_window_layer(layer, x, cos, sin, attn_mask, kv_cache.layer(i))
            else:
                x = layer(x, cos, sin, attn_mask, kv_cache.layer(i) if kv_cache is not None else None)
        return self.norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, attention_mask, position_ids, attn_mask))


def _call_layer(layer: nn.Module, x, cos, sin, mask, cache=None):
    return layer(x, cos, sin, mask, cache)


# Training (`model.compile`). dynamic=True: packed batches change their token count every step, which
# must not recompile. emulate_precision_casts: fused kernels round where eager rounds to bf16; without
# it Inductor keeps float32 across the casts, which on an LLaDA-8B LoRA step moved the loss by ~3 %
# (the numbers drift from the eager run's, not towards float32's); with it a tiny model's compiled
# bf16 loss equals the eager one bit for bit.
compiled_layer = LazyCompiled(_call_layer, dynamic=True, options={"emulate_precision_casts": True})

# Rollout windows (`compile_forward`, replayed as CUDA graphs): one compilation per window shape (a
# block, or the whole canvas at a refresh), shared by the 32 layers of an 8B model, where compiling
# the whole forward traced all of them once per shape (minutes of an RL run's first step). Rounded
# as eager rounds, so rollouts sample from the probabilities that training scores.
compiled_window_layer = LazyCompiled(_call_layer, dynamic=False, options={"emulate_precision_casts": True})


def default_position_ids(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Left padding shifts positions so that every sample's first real token is position 0."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


class LayerCache:
    """One layer's view of a `KVCache` during a windowed forward."""

    __slots__ = ("k", "v", "cols", "key_end")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cols: torch.Tensor, key_end: int):
        self.k, self.v, self.cols, self.key_end = k, v, cols, key_end

    def write_and_read(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_copy_ with a column tensor (not a Python slice) so that a CUDA graph can replay it at
        # any offset
        self.k.index_copy_(2, self.cols, k.to(self.k.dtype))
        self.v.index_copy_(2, self.cols, v.to(self.v.dtype))
        return self.k[:, :, :self.key_end], self.v[:, :, :self.key_end]


class KVCache:
    """Post-RoPE keys and values of every layer for a whole canvas: [B, Hkv, S, D] per layer.

    A forward over a window of columns writes the window's keys/values in place and attends to the
    first `key_end` columns, whatever mix of cached and fresh entries they hold; which columns are
    fresh on each step is the caller's policy (prefix, dual, block KV)."""

    def __init__(self, cfg: TransformerConfig, batch: int, length: int, dtype: torch.dtype, device):
        shape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.cols: torch.Tensor = torch.arange(0, device=device)
        self.key_end = length

    @property
    def length(self) -> int:
        return self.k[0].shape[2]

    def window(self, cols: torch.Tensor, key_end: int) -> "KVCache":
        self.cols, self.key_end = cols, key_end
        return self

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self.k[i], self.v[i], self.cols, self.key_end)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]
