"""What the bench's RL runs plug into the library by name (a synthetic reward), and the uncached
LLaDA-style denoising loop that bench/rollout.py's `reference` mode runs: every denoising step
re-encodes the whole canvas with logits at every position, samples by float64 Gumbel-max and
measures confidence by a float64 softmax over the full vocabulary. (The RL step's baseline is d1's
own code, run by bench/peer_d1.py, not a transcription of it.)
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch

REWARD = "bench_token_hash"


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


def register_rl_pieces() -> None:
    """The synthetic reward, by name (once)."""
    from dare_core.rewards import REWARDS, register_reward

    if REWARD not in REWARDS:
        register_reward(REWARD)(token_hash_reward)
