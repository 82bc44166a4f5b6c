"""What the bench's RL runs plug into the library by name: a synthetic reward, and the public d1
recipe (its rollout loop and its scoring) that the DARE step is measured against.

The public recipe is the baseline, so its work is kept as that recipe does it rather than routed
through the library's faster paths: every denoising step re-encodes the whole canvas with logits at
every position, samples by float64 Gumbel-max, measures confidence by a float64 softmax over the
full vocabulary; training takes logits over the whole canvas. Everything else (the canvas, the
output, the d1 estimator, the engine and algorithm registries) is the library's own.
bench/rollout.py's `reference` mode runs the same loop, greedy.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Optional

import torch

REWARD = "bench_token_hash"
PUBLIC = "bench_public_d1"  # the public recipe's rollout engine and algorithm, registered below


def token_hash_reward(response_text: str, ground_truth: str, extra: Optional[dict] = None):
    """A reward in [0, 1] keyed on the response's tokens (their text): rollouts of one prompt get
    different rewards, so group advantages are non-zero and the backward pass does real work."""
    from dare_core.rewards import RewardResult

    score = (zlib.crc32(response_text.encode()) % 1000) / 999
    return RewardResult(score, float(score >= 0.5), None)


def gumbel_max(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """d1's / LLaDA's `add_gumbel_noise` then argmax, in float64 as they compute it."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel = (-torch.log(noise)) ** temperature
    return (logits.exp() / gumbel).argmax(-1)


@torch.no_grad()
def public_recipe_denoise(model, canvas, params, max_blocks: Optional[int] = None) -> int:
    """Decode `canvas` (the library's `Canvas`) in place as the public LLaDA sampler does, over its
    first `max_blocks` blocks (all by default): per step, the whole canvas re-encoded, d1's Gumbel-max
    proposal, a float64 softmax confidence, and the top-k masked positions of the block committed row
    by row. Returns the number of model forwards."""
    x, mask_id, s, nfe = canvas.x, model.mask_token_id, params.steps_per_block, 0
    for lo, hi in canvas.blocks[:max_blocks]:
        m0 = (x[:, lo:hi] == mask_id).sum(-1)
        for j in range(s):
            logits = model(x, canvas.attn)  # every position's logits
            x0 = gumbel_max(logits, params.temperature)
            p = torch.softmax(logits.to(torch.float64), dim=-1)  # float64 over the full vocabulary
            conf = p.gather(-1, x0[..., None]).squeeze(-1)
            conf[:, :lo] = -math.inf
            conf[:, hi:] = -math.inf
            conf = torch.where(x == mask_id, conf, torch.full_like(conf, -math.inf))
            k = m0 // s + (j < m0 % s).long()
            for b in range(x.shape[0]):
                idx = conf[b].topk(int(k[b])).indices
                x[b, idx] = x0[b, idx]
            nfe += 1
    return nfe


class PublicRecipeSampler:
    """A rollout engine (the library's interface) whose rollouts are `public_recipe_denoise`'s."""

    name = PUBLIC

    def __init__(self, model, **_: object):
        self.model = model

    def update_weights(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def generate(self, prompts, params, generators=None, record: str = "none"):
        from dare_core.sampling.decode import Canvas, response_output

        if record != "none":
            raise ValueError("the public-recipe sampler records no trajectory")
        model = self.model
        device = next(model.parameters()).device
        canvas = Canvas.build(prompts, params, model.mask_token_id, model.pad_token_id, model.block_size is not None, device)
        nfe = public_recipe_denoise(model, canvas, params)
        cols = canvas.resp_start[:, None] + torch.arange(params.gen_length, device=device)
        response = canvas.x.gather(1, cols)
        response = response.masked_fill(response == model.mask_token_id, model.eos_token_id)
        stop_ids = torch.tensor(sorted({model.eos_token_id, *params.stop_token_ids}))
        steps = torch.full((len(prompts),), len(canvas.blocks) * params.steps_per_block)
        return response_output(prompts, response, model.pad_token_id, model.eos_token_id, stop_ids, nfe=nfe, steps=steps,
                               sampler={"engine": self.name, **dataclasses.asdict(params)})


def full_canvas_logprobs(model, batch, corruption) -> torch.Tensor:
    """d1's token log-probabilities as the public recipe computes them: logits at every position of
    the canvas (the prompt's too), a float32 log-softmax over the whole response canvas, then the
    scored positions kept. The library runs the LM head at the scored positions only."""
    from dare_core.diffusion.block import two_stream_hidden

    if model.family.shift_logits:
        raise ValueError("the public-recipe scoring is written for unshifted families (LLaDA, SDAR)")
    targets = corruption.targets if corruption.targets is not None else batch.input_ids
    if model.block_size is not None:
        hidden = two_stream_hidden(model, corruption.noisy_ids, targets, batch.attention_mask)
    else:
        hidden = model.hidden_states(corruption.noisy_ids, batch.attention_mask)
    logits = model.net.lm_head(hidden)
    p = batch.prompt_len
    logp = torch.log_softmax(logits[:, p:].float(), dim=-1).gather(-1, targets[:, p:, None]).squeeze(-1)
    out = torch.zeros(corruption.scored.shape, dtype=torch.float32, device=logits.device)
    out[:, p:] = logp
    return out.masked_fill(~corruption.scored, 0.0)


def register_rl_pieces() -> None:
    """The synthetic reward, and the public recipe's engine and estimator (the library's d1 with the
    recipe's scoring), by name (once)."""
    from dare_core.algorithms.d1 import D1
    from dare_core.algorithms.registry import RL_ALGORITHMS, register_rl
    from dare_core.rewards import REWARDS, register_reward
    from dare_core.sampling.engines import ENGINES

    if REWARD not in REWARDS:
        register_reward(REWARD)(token_hash_reward)
    if PUBLIC not in ENGINES:
        ENGINES.register(PUBLIC)(PublicRecipeSampler)
    if PUBLIC not in RL_ALGORITHMS:
        class PublicD1(D1):
            """d1 with the public recipe's scoring (logits over the whole canvas)."""

            def score(self, model, batch, corruption) -> torch.Tensor:
                return full_canvas_logprobs(model, batch, corruption)

        register_rl(PUBLIC)(PublicD1)
