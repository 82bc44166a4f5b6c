"""Padding and batching of tokenised rows into the prompt+canvas layout of `dare_core.batch.Batch`."""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import torch

from dare_core.batch import Batch
from dare_core.sampling.decode import left_pad


def sft_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], uids: list, pad_to: int, eos_id: int, pad_id: int,
              eos_padding: bool = True) -> Batch:
    """Left-pad prompts; responses get one EOS and fill a canvas of `pad_to` positions.

    eos_padding (masked diffusion): the rest of the canvas is EOS, attended and trained; it is how
    a masked diffusion LM learns to end an answer inside a fixed canvas. Otherwise (block diffusion)
    the rest is padding with attention 0, never trained. Responses are truncated, never prompts."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    resp = torch.full((len(responses), pad_to), eos_id if eos_padding else pad_id, dtype=torch.long)
    resp_mask = torch.ones_like(resp, dtype=torch.bool) if eos_padding else torch.zeros_like(resp, dtype=torch.bool)
    for i, r in enumerate(responses):
        r = (list(r) + [eos_id])[:pad_to]
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        resp_mask[i, : len(r)] = True
    input_ids = torch.cat([prompt_ids, resp], dim=1)
    attention_mask = torch.cat([prompt_mask, resp_mask.long()], dim=1)
    return Batch(input_ids, attention_mask, prompt_ids.shape[1], resp_mask, list(uids))


def pair_batch(prompts: Sequence[Sequence[int]], chosen: Sequence[Sequence[int]], rejected: Sequence[Sequence[int]], uids: list,
               pad_to: int, eos_id: int, pad_id: int, eos_padding: bool = True) -> Batch:
    """Preference pairs as 2P sequences in the SFT layout: pair k is rows 2k (chosen) and 2k+1
    (rejected), which share the prompt, the padded prompt length and the `pad_to` canvas; both rows
    carry the pair's uid (masks derive from it, docs/algorithms.md#preference-optimisation)."""
    twice = lambda xs: [x for x in xs for _ in range(2)]  # noqa: E731
    responses = [r for pair in zip(chosen, rejected) for r in pair]
    return sft_batch(twice(prompts), responses, twice(uids), pad_to, eos_id, pad_id, eos_padding)


@lru_cache(maxsize=4)
def epoch_permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    from dare_core.diffusion.seeding import generator

    return tuple(torch.randperm(n, generator=generator(seed, "data_order", epoch)).tolist())


def global_batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """Row indices of the global batch at `step`: a function of (seed, step) alone, so a resumed run
    sees exactly the data an uninterrupted one would."""
    out = []
    start = step * batch_size
    for pos in range(start, start + batch_size):
        epoch, offset = divmod(pos, n)
        out.append(int(epoch_permutation(n, seed, epoch)[offset]))
    return out


def row_tokens(prompt_len: int, response_len: int, pad_to: int, eos_padding: bool = True) -> int:
    """Positions a row of the SFT layout attends once packed (its forward/backward cost): the prompt
    and, under EOS padding, the whole canvas; otherwise the response and its EOS."""
    return prompt_len + (pad_to if eos_padding else min(response_len + 1, pad_to))


def balanced_micro_batches(idx: Sequence[int], cost: Callable[[int], int], micro_size: int) -> list[list[int]]:
    """The global batch `idx` cut into micro-batches of `micro_size` rows with near-equal total cost.

    Ranks take every world-th micro-batch and wait for each other at the gradient all-reduce, so a
    step lasts as long as its most expensive micro-batches: cut in data order, two micro-batches of
    16 packed rows drawn from 72 to 1024 tokens differ by about 15 %. Longest-first greedy filling
    (each row to the lightest micro-batch with room) leaves them within one row's cost of each
    other. The cut depends on the rows and `micro_size` only, never on the number of ranks, so a run
    on N GPUs trains on the micro-batches of the 1-GPU run; rows keep their order in `idx`."""
    count = len(idx) // micro_size
    if count <= 1:
        return [list(idx[o:o + micro_size]) for o in range(0, len(idx), micro_size)]
    costs = [cost(i) for i in idx]
    load, members = [0] * count, [[] for _ in range(count)]
    for k in sorted(range(len(idx)), key=lambda k: (-costs[k], k)):
        j = min((j for j in range(count) if len(members[j]) < micro_size), key=lambda j: (load[j], j))
        members[j].append(k)
        load[j] += costs[k]
    return [[idx[k] for k in sorted(m)] for m in members]
