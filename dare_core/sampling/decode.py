"""One denoising loop for masked diffusion LMs (ALGORITHMS.md 6.1).

The loop is fixed; what varies plugs in: an `Unmasker` decides how many masked positions of the
current block to commit each step (and which, given confidences), and a `Cache` decides which part
of the sequence is re-encoded each step (only `NoCache` exists so far; prefix/dual/block-KV caches
slot in behind the same two methods). Returns token ids, never text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from dare_core.models.transformer import default_position_ids
from dare_core.sampling.params import SamplingParams


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P+L]: left-padded prompt then the response canvas
    attention_mask: torch.Tensor  # [B, P+L]
    prompt_len: int
    nfe: int  # model forward passes
    step_map: Optional[torch.Tensor] = None  # [B, L] 1-based step at which each position was committed

    @property
    def response(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len:]


class Unmasker(Protocol):
    def counts(self, num_masked: torch.Tensor, step_in_block: int, steps_per_block: int) -> torch.Tensor: ...


class LinearScheduleUnmasker:
    """LLaDA's linear schedule: an even split k_j = floor(m/s) + [j < m mod s] of the block's m masks."""

    def counts(self, num_masked: torch.Tensor, step_in_block: int, steps_per_block: int) -> torch.Tensor:
        base = num_masked // steps_per_block
        return base + (step_in_block < num_masked % steps_per_block).long()


class Cache(Protocol):
    def logits(self, model, x: torch.Tensor, attention_mask: torch.Tensor, rows: slice) -> torch.Tensor: ...


class NoCache:
    """Re-encode the whole sequence every step; logits are projected only for the rows asked for."""

    def logits(self, model, x: torch.Tensor, attention_mask: torch.Tensor, rows: slice) -> torch.Tensor:
        hidden = model.hidden_states(x, attention_mask, default_position_ids(x, attention_mask))
        want = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        want[:, rows] = True
        return model.logits_at(hidden, want, attention_mask).view(x.shape[0], rows.stop - rows.start, -1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
            mask[i, width - len(p):] = 1
    return ids, mask


def gumbel_argmax(logits: torch.Tensor, temperature: float, generators: Optional[Sequence[torch.Generator]]) -> torch.Tensor:
    """argmax(l + T g), g ~ Gumbel in float64: a sample from softmax(l / T); T = 0 is argmax."""
    if temperature <= 0:
        return logits.argmax(-1)
    noise = torch.stack([
        -torch.log(-torch.log(torch.rand(logits.shape[1:], generator=g, dtype=torch.float64).clamp_min(1e-300)))
        for g in generators
    ]).to(logits.device)
    return (logits.double() + temperature * noise).argmax(-1)


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    generators: Optional[Sequence[torch.Generator]] = None,
    unmasker: Optional[Unmasker] = None,
    cache: Optional[Cache] = None,
    record_steps: bool = False,
    eot_id: Optional[int] = None,
) -> GenerationOutput:
    """Semi-autoregressive low-confidence remasking over left-padded prompts."""
    unmasker = unmasker or LinearScheduleUnmasker()
    cache = cache or NoCache()
    device = next(model.parameters()).device
    mask_id, eos_id = model.mask_token_id, model.eos_token_id
    if params.temperature > 0 or params.remasking == "random":
        if generators is None or len(generators) != len(prompts):
            raise ValueError("stochastic sampling needs one torch.Generator per prompt")
    limit = model.max_sequence_length
    longest = max(len(p) for p in prompts)
    if longest + params.gen_length > limit:
        raise ValueError(f"prompt of {longest} tokens + gen_length {params.gen_length} exceeds the model's maximum length {limit}")

    prompt_ids, prompt_mask = left_pad(prompts, model.pad_token_id, device)
    B, P, L = prompt_ids.shape[0], prompt_ids.shape[1], params.gen_length
    x = torch.cat([prompt_ids, torch.full((B, L), mask_id, dtype=torch.long, device=device)], dim=1)
    attn = torch.cat([prompt_mask, torch.ones((B, L), dtype=torch.long, device=device)], dim=1)
    step_map = torch.zeros((B, L), dtype=torch.long, device=device) if record_steps else None
    nfe, step = 0, 0
    for block in range(L // params.block_length):
        lo, hi = P + block * params.block_length, P + (block + 1) * params.block_length
        block_masked = (x[:, lo:hi] == mask_id).sum(-1)
        for j in range(params.steps_per_block):
            step += 1
            is_masked = x[:, lo:hi] == mask_id
            if not is_masked.any():
                break
            logits = cache.logits(model, x, attn, slice(lo, hi))
            nfe += 1
            if params.cfg_scale > 0:
                uncond = x.clone()
                uncond[:, :P] = torch.where(prompt_mask.bool(), torch.full_like(uncond[:, :P], mask_id), uncond[:, :P])
                logits_u = cache.logits(model, uncond, attn, slice(lo, hi))
                nfe += 1
                logits = logits_u + (params.cfg_scale + 1) * (logits - logits_u)
            logits = logits.float()
            if params.logits_eos_inf:
                logits[..., eos_id] = float("-inf")
            proposal = gumbel_argmax(logits, params.temperature, generators)
            if params.remasking == "low_confidence":
                conf = torch.softmax(logits, dim=-1).gather(-1, proposal[..., None]).squeeze(-1)
            else:
                conf = torch.stack([torch.rand(hi - lo, generator=g) for g in generators]).to(device)
            if params.confidence_eos_eot_inf:
                special = proposal == eos_id
                if eot_id is not None:
                    special |= proposal == eot_id
                conf = torch.where(special, torch.full_like(conf, -1.0), conf)
            conf = torch.where(is_masked, conf, torch.full_like(conf, float("-inf")))
            k = unmasker.counts(block_masked, j, params.steps_per_block).clamp(max=is_masked.sum(-1))
            order = conf.argsort(dim=-1, descending=True)
            rank = torch.empty_like(order)
            rank.scatter_(1, order, torch.arange(hi - lo, device=device).expand(B, -1))
            commit = (rank < k[:, None]) & is_masked
            x[:, lo:hi] = torch.where(commit, proposal, x[:, lo:hi])
            if step_map is not None:
                step_map[:, lo - P:hi - P][commit] = step
    leftover = x[:, P:] == mask_id
    x[:, P:][leftover] = eos_id
    return GenerationOutput(sequences=x, attention_mask=attn, prompt_len=P, nfe=nfe, step_map=step_map)


def decode_responses(tokenizer, output: GenerationOutput) -> list[str]:
    """Text of each response, cut at the first EOS, special tokens skipped."""
    eos = tokenizer.eos_token_id
    texts = []
    for row in output.response.tolist():
        if eos in row:
            row = row[: row.index(eos)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts
