"""The reference policy of the KL term (RL) and of the DPO margin (preference), in one place: a
frozen copy of the start model, or, with LoRA, the policy itself with its adapter disabled (no
second copy of the weights); and, for RL's rl.ref_sync_steps, making the copy the current policy."""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch

from dare_core.training import engine as eng


def frozen_reference(policy: torch.nn.Module, lora: Optional[dict], needed: bool = True) -> Optional[torch.nn.Module]:
    """A frozen copy of `policy` (taken before the engine wraps it), or None where none is kept:
    not `needed`, or LoRA (`reference_model` then disables the adapter instead)."""
    if not needed or lora is not None:
        return None
    return copy.deepcopy(policy).eval().requires_grad_(False)


@contextlib.contextmanager
def reference_model(policy: torch.nn.Module, frozen: Optional[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    """The reference policy: the frozen copy, or (LoRA, `frozen` None) the policy itself with its
    adapter disabled, in eval mode."""
    if frozen is not None:
        yield frozen
        return
    from dare_core.models.lora import adapter_disabled

    was_training = policy.training
    policy.eval()
    try:
        with adapter_disabled(policy):
            yield policy
    finally:
        policy.train(was_training)


def sync_reference(ref: torch.nn.Module, policy: torch.nn.Module, zero3: bool = False) -> None:
    """rl.ref_sync_steps: the frozen reference copy becomes the current policy, in place (its
    parameters and buffers; docs/algorithms.md#reference-policy). `policy` is the engine's module, whose weights
    are what the scores use (under bf16 the module's bf16 weights, not the optimiser's fp32
    master copy). Under ZeRO-3 each parameter is partitioned across the ranks: it is gathered, one
    at a time (no rank holds more than the reference plus one full parameter), and copied; ZeRO
    0-2 keep every parameter whole on every rank."""
    ref_params, ref_buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
    with torch.no_grad():
        for name, p in policy.named_parameters():
            with eng.gathered([p], zero3):
                ref_params[name].copy_(p)
        for name, b in policy.named_buffers():
            if name in ref_buffers:
                ref_buffers[name].copy_(b)
