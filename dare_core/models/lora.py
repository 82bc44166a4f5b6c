"""LoRA through peft on every family.

Targets are full module-path patterns over our generic module tree, so "all-linear" means the
attention and MLP (and expert) projections of every layer, never the LM head, the embeddings or an
MoE router (LLaDA's checkpoint names its head and its MLP output both `ff_out`; our tree does not).
The reference policy is the same module with the adapter disabled: no second copy of the weights.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

ALL_LINEAR = r"layers\.\d+\.(attn\.(q_proj|k_proj|v_proj|qkv_proj|o_proj)|mlp\.((experts\.\d+|shared)\.)?(gate_proj|up_proj|down_proj))"
# experts stored as stacked tensors (DiffusionGemma's [E, out, in]) are adapted per expert through
# peft's parameter targets; "all-linear" includes them wherever a model has them
FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
ATTENTION = r"layers\.\d+\.attn\.(q_proj|k_proj|v_proj|qkv_proj|o_proj)"
TARGETS = {"all-linear": ALL_LINEAR, "attention": ATTENTION}


@dataclass
class LoraSettings:
    r: int = 32
    alpha: int = 16
    dropout: float = 0.0
    targets: str = "all-linear"  # all-linear | attention | a regex over module paths


def apply_lora(model, settings: LoraSettings, generator: Optional[torch.Generator] = None):
    """Inject a LoRA adapter into `model.net` in place; only adapter weights stay trainable. With
    `generator`, each A is drawn from it (peft's law, U(-1/sqrt(fan_in), 1/sqrt(fan_in))) instead of
    from torch's global RNG, so that the same run seed starts the same adapter; B starts at zero."""
    from peft import LoraConfig, inject_adapter_in_model

    pattern = TARGETS.get(settings.targets, settings.targets)
    fused = [p for p in FUSED_EXPERTS if any(n.endswith(p) for n, _ in model.net.named_parameters())]
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=pattern, bias="none",
                        target_parameters=fused if settings.targets == "all-linear" and fused else None)
    # the adapter is made where the weights are: drawing it on the host and copying it over cost an
    # 8B model's stage start-up seconds at r = 128 (and on the meta device it costs nothing)
    with torch.device(next(model.net.parameters()).device):
        inject_adapter_in_model(config, model.net)
    if generator is not None:
        with torch.no_grad():
            for layer in lora_layers(model.net):
                weight = layer.lora_A["default"].weight
                bound = weight.shape[1] ** -0.5
                draw = torch.empty(weight.shape, device=generator.device, dtype=torch.float32)
                weight.copy_(draw.uniform_(-bound, bound, generator=generator))
    for name, p in model.net.named_parameters():
        p.requires_grad_("lora_" in name)
    model.lora = settings
    return model


def lora_layers(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return (m for m in module.modules() if isinstance(m, LoraLayer))


@contextlib.contextmanager
def adapter_disabled(model) -> Iterator[None]:
    """The reference policy: the base weights, adapter off (no copy)."""
    layers = list(lora_layers(model.net))
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@contextlib.contextmanager
def adapters_merged(model) -> Iterator[bool]:
    """The policy with each LoRA adapter folded into its base weight in place, `W + scale * B A`
    summed in float32 (or wider) and rounded once to W's dtype (docs/sampling.md#merged-lora-rollouts); yields
    whether anything was merged. A forward then runs one GEMM per projection instead of three and an
    add. On exit each base weight is copied back from a copy taken before (subtracting the delta again
    would not give W back in bf16), so training sees its weights bit for bit; the copy costs the
    adapted weights' memory once more while the block runs."""
    # (a stacked-experts adapter, peft's ParamWrapper, adds its delta inside the forward already)
    layers = [m for m in lora_layers(model.net) if not m.merged and "default" in m.lora_A and hasattr(m.get_base_layer(), "weight")]
    saved = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.get_base_layer().weight
                saved.append((layer, weight, weight.detach().clone()))
                wide = torch.promote_types(weight.dtype, torch.float32)
                weight.copy_(weight.to(wide) + layer.get_delta_weight("default").to(wide))
                layer.merged_adapters.append("default")  # peft's forward then runs the base layer alone
        model._dare_lora_merged = bool(layers)
        yield bool(layers)
    finally:
        with torch.no_grad():
            for layer, weight, original in saved:
                weight.copy_(original)
                layer.merged_adapters.remove("default")
        model._dare_lora_merged = False


def base_tensors(net: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, Optional[torch.nn.Module]]]:
    """(generic name, base tensor, the LoRA layer that adapts it or None) for every tensor of `net`'s
    state dict but the adapters' own, in state-dict order; wrapper names are cleaned
    ("q_proj.base_layer.weight" -> "q_proj.weight"). Nothing is computed or copied."""
    adapted, params = {}, {}
    for name, m in net.named_modules():
        if "lora_A" in dict(m.named_children()):
            if hasattr(m, "parameter_name"):  # peft's ParamWrapper: it adapts one parameter of its base
                params[f"{_unwrapped(name)}.{m.parameter_name}"] = m
            else:
                adapted[_unwrapped(name)] = m
    for name, tensor in net.state_dict().items():
        if "lora_" in name:
            continue
        clean = _unwrapped(name)
        owner = clean.rsplit(".", 1)[0]
        layer = params.get(clean) or (adapted.get(owner) if clean.endswith(".weight") else None)
        yield clean, tensor, layer


def _unwrapped(name: str) -> str:
    """A module or tensor path without peft's wrappers ("q_proj.base_layer.weight" -> "q_proj.weight";
    wrappers nest where one module has several adapted parameters)."""
    return re.sub(r"(\.base_layer)+(?=\.|$)", "", name)


def fold(weight: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """W + scale * B A for one adapted weight, computed on W's device and stored in W's dtype (a GPU
    model merges on the GPU; nothing goes through a float32 copy on the host)."""
    with torch.no_grad():
        return weight.detach() + layer.get_delta_weight("default").to(weight.dtype)


def merged_tensors(net: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Generic-named base weights with every adapter folded in, one at a time: an export that writes
    each before asking for the next holds at most one merged weight, never a merged copy of the model."""
    for name, tensor, layer in base_tensors(net):
        yield name, fold(tensor, layer) if layer is not None else tensor.detach()


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """Generic-named base weights with every adapter folded in (W + scale * B A), all at once."""
    return dict(merged_tensors(model.net))
