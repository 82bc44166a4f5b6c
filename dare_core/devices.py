"""Where this process computes and in which precision: shared by training, rollouts and evaluation."""
from __future__ import annotations

import os

import torch


def device() -> torch.device:
    """This rank's GPU (LOCAL_RANK) when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]
    except KeyError:
        raise ValueError(f"model.dtype must be auto, float32 or bfloat16, got '{name}'") from None
