"""What lmdeploy is asked to do, as pure functions (docs/sampling.md#engines): the mapping of our
sampler settings onto lmdeploy's engine and request settings (refusing what it cannot honour
exactly), session lengths, per-prompt seeds and the layout of what comes back. Checked on CPU
without lmdeploy."""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Optional, Sequence

import torch

from dare_core.sampling.decode import GenerationOutput, response_output
from dare_core.sampling.params import SamplingParams

# our unmasking name -> lmdeploy's `dllm_unmasking_strategy`. lmdeploy's `low_confidence_dynamic`
# commits every masked position with confidence >= threshold and at least the top-1, which is our
# `threshold`; our `dynamic` (falls back to the top k_j, so a block ends within `steps`) has no
# counterpart there.
UNMASKING = {"topk": "low_confidence_static", "threshold": "low_confidence_dynamic", "sequential": "sequential"}
MAX_TEMPERATURE = 2.0  # lmdeploy's GenerationConfig asserts temperature <= 2


def map_params(params: SamplingParams, model_block_size: Optional[int], eos_token_id: int,
               record: str = "none") -> tuple[dict, dict]:
    """(engine settings, request settings): `PytorchEngineConfig` dllm_* fields and
    `GenerationConfig` fields (less the seed) that decode as our sampler would, or ValueError
    naming what lmdeploy cannot do."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"the lmdeploy engine cannot honour {what}; use engine 'native' for it")

    if model_block_size is None:
        raise ValueError("the lmdeploy engine decodes block-diffusion models (SDAR) only")
    if params.block_length != model_block_size:
        raise ValueError(f"this model was trained with blocks of {model_block_size}; set block_length: {model_block_size}")
    if record != "none":
        raise refuse(f"record='{record}' (lmdeploy does not report per-step commits)")
    if params.cache != "block_kv":
        raise refuse(f"cache '{params.cache}' (lmdeploy always decodes with the block KV cache: set cache: block_kv)")
    if params.cfg_scale > 0:
        raise refuse("classifier-free guidance (cfg_scale > 0)")
    if params.edit_threshold is not None:
        raise refuse("token editing (edit_threshold)")
    if params.unmasking not in UNMASKING:
        hint = " (lmdeploy's low_confidence_dynamic is our 'threshold': no top-k_j floor)" if params.unmasking == "dynamic" else ""
        raise refuse(f"unmasking '{params.unmasking}'{hint}; it has {sorted(UNMASKING)}")
    if params.alg_temp > 0:
        raise refuse("alg_temp > 0 (positions drawn at random)")
    if params.confidence_eos_eot_inf:
        raise refuse("confidence_eos_eot_inf")
    if params.temperature > MAX_TEMPERATURE:
        raise refuse(f"temperature {params.temperature} > {MAX_TEMPERATURE}")
    steps = params.steps_per_block
    if params.unmasking != "threshold":
        # lmdeploy commits block_length // steps positions per step, not an even split
        if params.schedule != "linear":
            raise refuse(f"schedule '{params.schedule}'")
        if params.block_length % steps:
            raise refuse(f"{steps} steps per block of {params.block_length} (lmdeploy commits block_length // steps per step; "
                         "choose steps per block dividing block_length)")
    if params.unmasking != "sequential":
        # lmdeploy's confidence is softmax(logits / T)[x] (T = 1 when greedy), before top-k/top-p
        filtered = params.top_k > 0 or params.top_p < 1
        tempered = params.temperature not in (0.0, 1.0)
        if params.remasking == "low_confidence" and tempered:
            raise refuse(f"remasking 'low_confidence' at temperature {params.temperature} (lmdeploy's confidence is tempered; "
                         "use remasking: maskgit_plus without top_k/top_p, or temperature 0 or 1)")
        if params.remasking == "maskgit_plus" and filtered:
            raise refuse("remasking 'maskgit_plus' with top_k/top_p (lmdeploy's confidence ignores the filtering; "
                         "use remasking: low_confidence at temperature 0 or 1)")
        if params.remasking not in ("low_confidence", "maskgit_plus"):
            raise refuse(f"remasking '{params.remasking}'")
    engine = {
        "dllm_block_length": params.block_length,
        "dllm_unmasking_strategy": UNMASKING[params.unmasking],
        "dllm_denoising_steps": steps,
        "dllm_confidence_threshold": float(params.threshold),
    }
    stop = sorted({int(eos_token_id), *params.stop_token_ids}) if params.stop_at_eos else None
    request = {
        "max_new_tokens": params.gen_length,
        "min_new_tokens": 0,
        # lmdeploy turns temperature 0 into greedy (top_k = 1); the low-level engine never reads do_sample
        "do_sample": params.temperature > 0,
        "temperature": float(params.temperature),
        "top_k": int(params.top_k),  # 0 = off in lmdeploy too (its GenerationConfig default is 50)
        "top_p": float(params.top_p),
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        # ignore_eos would ban the stop ids; without stop ids the engine decodes all gen_length tokens
        "ignore_eos": False,
        "stop_token_ids": stop,
        "bad_token_ids": [int(eos_token_id)] if params.logits_eos_inf else None,
    }
    return engine, request


def required_length(prompt_lens: Sequence[int], gen_length: int, block_length: int) -> int:
    """Positions the longest request occupies: prompt + response, rounded up to whole blocks
    (blocks sit on absolute positions, so the last one may run past the response)."""
    if not prompt_lens or min(prompt_lens) <= 0:
        raise ValueError("every prompt needs at least one token")
    return max(math.ceil((n + gen_length) / block_length) * block_length for n in prompt_lens)


def session_length(required: int, max_length: int, requested: Optional[int] = None) -> int:
    """The engine's session_len: covers prompt + response (the reference framework's server had
    2048 < 512 + 2048 and lmdeploy silently shortens max_new_tokens to fit), at most the model's
    maximum length. Defaults to that maximum, so later batches with longer prompts fit too."""
    if required > max_length:
        raise ValueError(f"prompt + gen_length needs {required} positions, more than the model's maximum length {max_length}")
    if requested is None:
        return max_length
    if requested < required:
        raise ValueError(f"session_len {requested} is shorter than prompt + gen_length ({required} positions); "
                         "lmdeploy would cut the responses short")
    return min(requested, max_length)


def request_seeds(n: int, generators: Optional[Sequence[torch.Generator]] = None,
                  seeds: Optional[Sequence[int]] = None) -> list[Optional[int]]:
    """One seed per prompt. Drawn from each prompt's generator (so a generator used twice gives two
    different rollouts, as with the native loop), or given explicitly; None lets lmdeploy choose."""
    if seeds is not None:
        if len(seeds) != n:
            raise ValueError(f"{len(seeds)} seeds for {n} prompts")
        return [int(s) for s in seeds]
    if generators is None:
        return [None] * n
    if len(generators) != n:
        raise ValueError(f"{len(generators)} generators for {n} prompts")
    # lmdeploy keeps the low 32 bits of random_seed
    return [int(torch.randint(0, 2**32, (1,), generator=g, device=g.device)) for g in generators]


def assemble_output(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], params: SamplingParams,
                    pad_token_id: int, eos_token_id: int, seeds: Optional[Sequence[Optional[int]]] = None) -> GenerationOutput:
    """The native loop's layout from engine token ids: [left-padded prompt | gen_length response],
    EOS after the first stop token and as padding of a response that stopped early."""
    L = params.gen_length
    stop_ids = {int(eos_token_id), *params.stop_token_ids}
    rows = []
    for i, ids in enumerate(responses):
        ids = [int(t) for t in ids]
        first = next((j for j, t in enumerate(ids) if t in stop_ids), None)
        if len(ids) > L or (first is None and len(ids) < L):
            raise ValueError(f"response {i} has {len(ids)} tokens and {'a' if first is not None else 'no'} stop token "
                             f"for gen_length {L}: the engine cut or overran it (session_len, max_new_tokens)")
        rows.append(ids + [eos_token_id] * (L - len(ids)))
    response = torch.tensor(rows, dtype=torch.long).reshape(len(rows), L)
    # lmdeploy reports neither forwards nor denoising steps
    return response_output(prompts, response, pad_token_id, eos_token_id, torch.tensor(sorted(stop_ids)), nfe=0,
                           steps=torch.zeros(len(rows), dtype=torch.long),
                           sampler={"engine": "lmdeploy", **asdict(params), "seeds": list(seeds) if seeds is not None else None})
