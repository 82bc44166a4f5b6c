"""The one rollout path: prompts in, completions out (token ids and their text), through whichever
rollout engine the config names. RL rollouts (`algorithms/rollout.py`), in-loop validation
(`eval/validation.py`) and benchmark generation (`eval/lm.py`) all decode through `generate`, so a
setting of the engine (`rl.sampler.engine`, its `engine_args`) reaches every one of them; grading
the texts is `rewards/grading.py`'s."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from dare_core.diffusion.seeding import generator
from dare_core.sampling.decode import GenerationOutput, decode_responses
from dare_core.sampling.engines import RolloutEngine
from dare_core.sampling.params import SamplingParams


@dataclass
class Completions:
    """The engine's outputs, one per batch of prompts (in prompt order), and every response's text."""

    outputs: list[GenerationOutput]
    texts: list[str]
    seconds: float  # wall time of the decoding (the texts not included)

    @property
    def nfe(self) -> int:
        return sum(o.nfe for o in self.outputs)


def generate(engine: RolloutEngine, tokenizer, prompts: Sequence[Sequence[int]], params: SamplingParams,
             seeds: Sequence[tuple], batch_size: int, record: str = "none") -> Completions:
    """Decode every prompt (token ids) in batches of `batch_size`, in order. Prompt i draws from its own
    generator seeded by `seeds[i]` (the parts of `diffusion.seeding.generator`), so a response does
    not depend on the batch it shared. The engine's model decodes in eval mode and is left in the
    train/eval mode it came in."""
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model = engine.model
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    outputs = []
    t0 = time.time()
    try:
        for start in range(0, len(prompts), batch_size):
            gens = [generator(*seed, device=device) for seed in seeds[start:start + batch_size]]
            outputs.append(engine.generate(prompts[start:start + batch_size], params, generators=gens, record=record))
    finally:
        model.train(was_training)
    seconds = time.time() - t0
    return Completions(outputs, [text for out in outputs for text in decode_responses(tokenizer, out)], seconds)
