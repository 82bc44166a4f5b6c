"""The one rollout path: prompts in, completions out (token ids and their text), through whichever
rollout engine the config names. RL rollouts (`algorithms/rollout.py`), in-loop validation
(`eval/validation.py`) and benchmark generation (`eval/lm.py`) all decode through `generate`, so a
setting of the engine (`rl.sampler.engine`, its `engine_args`) reaches every one of them; grading
the texts is `rewards/grading.py`'s."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dare_core.diffusion.seeding import generator
from dare_core.sampling.decode import GenerationOutput, decode_responses
from dare_core.sampling.params import SamplingParams
from dare_core.sampling.rollout_engine import RolloutEngine


@dataclass
class Completions:
    """The engine's outputs, one per batch of prompts (in prompt order), and every response's text."""

    outputs: list[GenerationOutput]
    texts: list[str]
    seconds: float  # wall time of the decoding (the texts not included)

    @property
    def nfe(self) -> int:
        return sum(o.nfe for o in self.outputs)


@dataclass(frozen=True)
class DecodeShare:
    """Ranks that decode one list of prompts together (a sequence-parallel group: its ranks train on
    the same rollouts): rank `rank` of `size` decodes a contiguous share, and `gather` (a collective
    over the group: each rank's list in, every rank's lists out, in rank order) gives every rank all
    the outputs. A prompt's response depends only on its seed, so the shares decode what one rank
    decoding them all would."""

    rank: int
    size: int
    gather: Callable[[list], list]

    def bounds(self, n: int) -> tuple[int, int]:
        """This rank's share [lo, hi) of n prompts: contiguous, sizes differing by at most one."""
        base, extra = divmod(n, self.size)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (self.rank < extra)


def moved(obj, device):
    """`obj` (a tensor, or a dataclass of them such as GenerationOutput) with its tensors on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: moved(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init})
    return obj


def generate(engine: RolloutEngine, tokenizer, prompts: Sequence[Sequence[int]], params: SamplingParams,
             seeds: Sequence[tuple], batch_size: int, record: str = "none", share: Optional[DecodeShare] = None) -> Completions:
    """Decode every prompt (token ids) in batches of `batch_size`, in order. Prompt i draws from its own
    generator seeded by `seeds[i]` (the parts of `diffusion.seeding.generator`), so a response does
    not depend on the batch it shared. The engine's model decodes in eval mode and is left in the
    train/eval mode it came in. With a `share`, this rank decodes its share of the prompts and gets
    the others' outputs from the group (every rank of it must call)."""
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model = engine.model
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    outputs = []
    lo, hi = share.bounds(len(prompts)) if share is not None else (0, len(prompts))
    t0 = time.time()
    try:
        for start in range(lo, hi, batch_size):
            end = min(start + batch_size, hi)
            gens = [generator(*seed, device=device) for seed in seeds[start:end]]
            outputs.append(engine.generate(prompts[start:end], params, generators=gens, record=record))
    finally:
        model.train(was_training)
    if share is not None:  # (on the CPU: a pickled GPU tensor would land on the sender's GPU)
        outputs = [moved(o, device) for part in share.gather([moved(o, "cpu") for o in outputs]) for o in part]
    seconds = time.time() - t0
    return Completions(outputs, [text for out in outputs for text in decode_responses(tokenizer, out)], seconds)
