"""Sampler settings (no torch import: the config schema builds on them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    gen_length: int = 8
    steps: int = 8
    block_length: int = 8
    temperature: float = 0.0
    remasking: str = "low_confidence"  # low_confidence | random
    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False

    def __post_init__(self) -> None:
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length {self.gen_length} must be divisible by block_length {self.block_length}")
        blocks = self.gen_length // self.block_length
        if self.steps % blocks:
            raise ValueError(f"steps {self.steps} must be divisible by the number of blocks {blocks}")
        if self.remasking not in ("low_confidence", "random"):
            raise ValueError(f"unknown remasking '{self.remasking}'")

    @property
    def steps_per_block(self) -> int:
        return self.steps // (self.gen_length // self.block_length)
