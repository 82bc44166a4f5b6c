"""Small real rollouts of the tiny models as RL batches (prompt, response, valid region, records),
for the algorithm tests."""
from typing import Optional

import torch

from dare_core.algorithms.rollout import _records
from dare_core.batch import Batch
from dare_core.config import SamplerConfig
from dare_core.diffusion.masking import valid_region
from dare_core.diffusion.seeding import generator, sample_generators
from dare_core.sampling.decode import generate
from dare_core.sampling.engines import build_engine


def sampler_for(model, **kw) -> SamplerConfig:
    """A cache-free sampler that fits the model (block diffusion: block_length = the model's block)."""
    bl = model.block_size or 4
    args = {"gen_length": 8, "steps": 8, "block_length": bl, "temperature": 1.0, **kw}
    if model.family.noise == "uniform":  # (DiffusionGemma: its own rule)
        args.setdefault("unmasking", "entropy_bound_renoise")
    return SamplerConfig(**args)


def rollout_batch(model, sampler: SamplerConfig, n: int = 4, prompt_len: int = 5, seed: int = 0, record: str = "steps",
                  advantages: Optional[torch.Tensor] = None, same_length: bool = False):
    """n rollouts of random prompts (lengths prompt_len-1 .. prompt_len, so some are left-padded,
    unless same_length): the training batch the RL loop would build, and the sampler's output."""
    g = generator(seed, "prompts")
    lens = [prompt_len - (0 if same_length else i % 2) for i in range(n)]
    prompts = [torch.randint(0, 60, (k,), generator=g).tolist() for k in lens]
    uids = [f"s{seed}-{i}" for i in range(n)]
    record = record if model.family.noise == "masked" else "none"  # (uniform noise keeps no trajectory)
    out = generate(model, prompts, sampler, sample_generators((seed, "rollout"), uids), record=record)
    P = out.prompt_len
    valid = valid_region(out.response, model.eos_token_id, out.attention_mask[:, P:])
    records = {}
    if out.trajectory is not None:
        # as the RL rollout records them: a block-diffusion terminal block whole, past gen_length,
        # and under token editing which step edited what
        records = _records([out], frozenset({"step_map", "decoded"}), model.block_size)
    if advantages is None:
        advantages = torch.linspace(-1.0, 1.0, n)
    return Batch(out.sequences, out.attention_mask, P, valid, uids, advantages, records), out


class RecordingEngine:
    """The native engine, keeping the prompts it was asked to decode."""

    name = "recording"

    def __init__(self, model):
        self.model, self.native, self.prompts = model, build_engine("native", model), []

    def generate(self, prompts, params, generators=None, record="none"):
        self.prompts += [list(p) for p in prompts]
        return self.native.generate(prompts, params, generators=generators, record=record)

    def update_weights(self, model) -> None:
        self.model = model
