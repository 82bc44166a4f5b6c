"""Sampler settings (no torch import: the config schema builds on them). docs/sampling.md#sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

# how a position's confidence is measured (6.1, 6.2)
REMASKING = ("low_confidence", "maskgit_plus", "topk_margin", "entropy", "random")
# how many / which masked positions of the current block are committed each step (6.1-6.4)
UNMASKING = ("topk", "threshold", "dynamic", "factor", "entropy_bounded", "sequential", "origin")
# the rule of a uniform-noise family (DiffusionGemma), which has no mask token: every position is
# redrawn each step, the entropy bound picks the draws that stay, the rest become random tokens again
UNIFORM_NOISE_RULES = ("entropy_bound_renoise",)
# how many positions a count-based unmasker commits per step: LLaDA's even split or Dream's timesteps
SCHEDULES = ("linear", "dream")
CACHES = ("none", "prefix", "dual", "block_kv")
# LLaDA2.1's published decoding modes (its model card's best practices; docs/sampling.md#token-editing):
# greedy threshold decoding with token editing, a lower commit threshold and free editing for speed
EDITING_MODES = {
    "speed": {"unmasking": "threshold", "temperature": 0.0, "threshold": 0.5, "edit_threshold": 0.0, "post_edit_steps": 16},
    "quality": {"unmasking": "threshold", "temperature": 0.0, "threshold": 0.7, "edit_threshold": 0.5, "post_edit_steps": 16},
}


def expand_editing(settings: dict) -> dict:
    """`settings` with its `editing` (speed | quality: a key of `EDITING_MODES`) replaced by that
    mode's settings, the other keys of `settings` over them."""
    if "editing" not in settings:
        return settings
    rest = {k: v for k, v in settings.items() if k != "editing"}
    if settings["editing"] not in EDITING_MODES:
        raise ValueError(f"unknown editing mode '{settings['editing']}'; known: {sorted(EDITING_MODES)}")
    return {**EDITING_MODES[settings["editing"]], **rest}


@dataclass
class SamplingParams:
    gen_length: int = 8
    # total denoising steps over gen_length (steps per block = steps / number of blocks); count-based
    # unmaskers finish a block in exactly that many steps, threshold-like ones take as many as they need
    steps: int = 8
    block_length: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # low_confidence: softmax(logits)[x] untempered (LLaDA); maskgit_plus: p(x) under the tempered,
    # filtered distribution (Dream, SDAR); topk_margin: p1 - p2; entropy: sum p log p; random: U(0,1)
    remasking: str = "low_confidence"
    unmasking: str = "topk"
    schedule: str = "linear"
    threshold: float = 0.9  # threshold / dynamic: commit every masked position with confidence >= threshold
    factor: float = 1.0  # factor: commit the largest n with (n+1)(1 - c_(n)) < factor
    entropy_bound: float = 0.35  # entropy_bounded: cumulative vocabulary entropy budget per step
    # entropy_bound_renoise: the temperature falls linearly over each block's steps from `temperature`
    # to `temperature_min` (None: constant); a block ends early once its argmax canvas has repeated
    # for `stable_steps` steps and its mean entropy is under `stop_entropy`
    temperature_min: Optional[float] = None
    stable_steps: int = 1
    stop_entropy: float = 0.005
    # token editing (LLaDA2.1, docs/sampling.md#token-editing): a committed, non-prompt position of the
    # current block takes the step's proposal when that differs from it and its confidence is above
    # edit_threshold (0.0: whenever the proposal differs); None: committed tokens are final. Once a
    # block has no mask left, up to post_edit_steps more steps may edit it, until a step edits nothing
    edit_threshold: Optional[float] = None
    post_edit_steps: int = 16
    alg_temp: float = 0.0  # > 0: positions drawn from softmax(confidence / alg_temp) instead of top-k (Dream)
    cache: str = "none"
    # prefix/dual: re-encode the whole sequence at the start of each block and, if > 0, also every
    # refresh_every steps inside a block (1 = every step, which reproduces decoding without a cache)
    refresh_every: int = 0
    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    # a sequence stops once a finished block holds EOS or one of these ids; what follows is cut (EOS)
    stop_at_eos: bool = True
    stop_token_ids: list = field(default_factory=list)
    # replay the cached one-block forward as a CUDA graph (GPU, dense models, no CFG); None = auto
    cuda_graphs: Optional[bool] = None
    # torch.compile that forward before capturing it (fewer, fused kernels; compiles once per batch size)
    compile_forward: bool = False
    # decode with each LoRA adapter folded into its base weight (one GEMM per projection, not three);
    # logits then differ from the adapter's own by the weights' rounding (docs/sampling.md#merged-lora-rollouts)
    lora_merged: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            # NaN passes every range check below (it compares false) and reaches the sampler
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
        for name in ("gen_length", "block_length", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length {self.gen_length} must be divisible by block_length {self.block_length}")
        blocks = self.gen_length // self.block_length
        if self.steps % blocks:
            raise ValueError(f"steps {self.steps} must be divisible by the number of blocks {blocks}")
        for name, value, allowed in (("remasking", self.remasking, REMASKING), ("unmasking", self.unmasking, UNMASKING + UNIFORM_NOISE_RULES),
                                     ("schedule", self.schedule, SCHEDULES), ("cache", self.cache, CACHES)):
            if value not in allowed:
                raise ValueError(f"unknown {name} '{value}'; known: {list(allowed)}")
        self._check_steps_fit()
        if self.temperature < 0 or self.alg_temp < 0:
            raise ValueError("temperature and alg_temp must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.refresh_every < 0:
            raise ValueError("top_k and refresh_every must be >= 0")
        if self.unmasking in UNIFORM_NOISE_RULES and (self.temperature <= 0 or (self.temperature_min or 1) <= 0):
            raise ValueError(f"unmasking '{self.unmasking}' samples every position: temperature and temperature_min must be > 0")
        if self.edit_threshold is not None and (self.edit_threshold < 0 or self.unmasking in UNIFORM_NOISE_RULES):
            raise ValueError("edit_threshold must be >= 0 (0.0 edits whenever the proposal differs; leave it empty for no "
                             "editing), and applies to masked-diffusion rules")
        if self.post_edit_steps < 0:
            raise ValueError(f"post_edit_steps must be >= 0, got {self.post_edit_steps}")
        if self.stable_steps < 0 or self.stop_entropy < 0:
            raise ValueError("stable_steps and stop_entropy must be >= 0")
        if self.factor <= 0 or self.entropy_bound < 0:
            raise ValueError("factor must be > 0 and entropy_bound >= 0")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    def _check_steps_fit(self) -> None:
        # Dream's timestep grid (schedule dream, unmasking origin) is defined for any number of
        # steps; every other rule commits at least one token per step, so steps beyond gen_length
        # would silently never run
        # (a uniform-noise block takes as many steps as its budget allows, whatever its length)
        if (self.steps > self.gen_length and self.schedule != "dream" and self.unmasking != "origin"
                and self.unmasking not in UNIFORM_NOISE_RULES):
            raise ValueError(f"steps {self.steps} > gen_length {self.gen_length}: at most one step per generated token "
                             f"runs (unmasking '{self.unmasking}', schedule '{self.schedule}'); set steps <= gen_length")

    @property
    def steps_per_block(self) -> int:
        return self.steps // (self.gen_length // self.block_length)

    @property
    def stochastic(self) -> bool:
        """Whether decoding draws random numbers (and so needs one generator per prompt)."""
        return (self.temperature > 0 or self.remasking == "random" or self.unmasking in ("origin", *UNIFORM_NOISE_RULES)
                or self.alg_temp > 0)
