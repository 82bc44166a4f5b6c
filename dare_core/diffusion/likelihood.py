"""Likelihood estimators shared by every algorithm.

Algorithms never call the model for likelihoods themselves: they hand a `Corruption` (from
`masking`) to these functions, so the same corrupted inputs serve old, reference and current
policy. Logits are computed only at scored rows and log-softmax is taken there in float32.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dare_core.diffusion.block import two_stream_hidden
from dare_core.diffusion.masking import Corruption, full_response_corruption, valid_region


def token_logprobs(model, corruption: Corruption, targets: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p_theta(targets_i | noisy) at every scored position, 0 elsewhere; float32 [B, S].

    Block-diffusion models score all blocks in one pass of the two-stream layout [x_t ; x_0],
    each noisy block seeing only the clean blocks before it."""
    if model.block_size is not None:
        hidden = two_stream_hidden(model, corruption.noisy_ids, targets, attention_mask)
    else:
        hidden = model.hidden_states(corruption.noisy_ids, attention_mask)
    rows = corruption.scored
    logits = model.logits_at(hidden, rows, attention_mask).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[rows][:, None]).squeeze(-1)
    out = torch.zeros(rows.shape, dtype=torch.float32, device=hidden.device)
    return out.masked_scatter(rows, logp)


def weighted_masked_nll(model, corruption: Corruption, targets: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample sum over masked positions of CE_i / p  ([B]): an unbiased negative-ELBO estimate."""
    logp = token_logprobs(model, corruption, targets, attention_mask)
    return -(logp.sum(dim=1) / corruption.p.to(logp.device))


def mean_field_corruption(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    eos_id: int,
    mask_id: int,
    p_mask_prompt: float,
    generators: Sequence[torch.Generator],
) -> Corruption:
    """The d1 one-step estimator's input (ALGORITHMS.md 2.1): scores every valid response token
    given a fully masked response and a lightly noised prompt."""
    response = input_ids[:, prompt_len:]
    valid = valid_region(response, eos_id, attention_mask[:, prompt_len:])
    return full_response_corruption(input_ids, attention_mask, prompt_len, valid, mask_id, p_mask_prompt, generators)
