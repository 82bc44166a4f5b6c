"""SDAR rollouts through lmdeploy's PyTorch engine, in this process (docs/sampling.md#block-diffusion-decoding, docs/sampling.md#rollout-records).

The engine and its scheduler live in the calling process (`lmdeploy.pytorch.engine.Engine`, no HTTP
server); prompts go in and response token ids come out, never text. What varies per request
(temperature, top-k/top-p, stop ids, length, seed) travels in each request's `GenerationConfig`;
what lmdeploy fixes when the engine starts (block length, denoising steps, unmasking strategy,
threshold) is set from the first call's `SamplingParams`, and a later call that differs is refused.

Everything that can be checked without lmdeploy is a pure function here (parameter mapping,
session length, seeds, output layout, weight chunks); lmdeploy itself is imported only by the
engine class, so CPU installs never need it.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import torch

from dare_core.models.family import own_families
from dare_core.sampling.decode import GenerationOutput, response_output
from dare_core.sampling.engines import ENGINES
from dare_core.sampling.params import SamplingParams

MIN_VERSION = (0, 10, 2)  # SDAR landed in 0.10.1; from 0.10.2 the engine streams token-id increments
INSTALL_HINT = ("the lmdeploy rollout engine needs lmdeploy >= 0.10.2 and a CUDA GPU: "
                "pip install 'dare[lmdeploy]'")
ENGINE = "lmdeploy"
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


def weight_chunks(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Named tensors in groups of at most max_bytes (a larger tensor goes alone), so one
    update_params call never holds more than one group's copy on the GPU."""
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    chunks: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name in sorted(state):
        t = state[name]
        nbytes = t.numel() * t.element_size()
        if not chunks or (chunks[-1] and size + nbytes > max_bytes):
            chunks.append([])
            size = 0
        chunks[-1].append((name, t))
        size += nbytes
    return chunks


# the files through which transformers' Auto* classes import a checkpoint's own code (their auto_map)
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")


def served_folder(model_path: Path, view: Path) -> Path:
    """The folder lmdeploy is pointed at: `view`, links to `model_path`'s files, with config.json and
    tokenizer_config.json rewritten without their auto_map. lmdeploy decodes SDAR with model code of its
    own and transformers' Qwen2 tokenizer, yet reads both files through Auto* classes with
    trust_remote_code, which import the modules auto_map names (configuration_sdar.py,
    tokenization_qwen2.py). A folder DARE saved keeps those entries but holds no such module (DARE never
    copies model code), so that read fails; a download that holds them would run the checkpoint's
    Python for nothing. Without auto_map, transformers reads the config as a plain one with every field
    and the tokenizer by its tokenizer_class."""
    view.mkdir(parents=True)
    for f in model_path.iterdir():
        if f.name in REMOTE_CODE_FILES:
            data = json.loads(f.read_text())
            data.pop("auto_map", None)
            (view / f.name).write_text(json.dumps(data, indent=2))
        elif f.suffix != ".py":
            (view / f.name).symlink_to(f.resolve())
    return view


def check_model(model) -> None:
    """The checkpoint families and mask id lmdeploy's dLLM path decodes correctly."""
    model_type = model.family.model_type
    # the families that say lmdeploy decodes them (`Family.engine_mask_ids`)
    served = [f for f in own_families() if ENGINE in f.engine_mask_ids]
    family = next((f for f in served if f.model_type == model_type), None)
    if model.block_size is None or family is None:
        labels = "/".join(dict.fromkeys(f.eval_label for f in served))
        raise ValueError(f"the lmdeploy engine decodes {labels} models ({tuple(f.model_type for f in served)}), not '{model_type}'")
    # lmdeploy's config builder hard-codes the released checkpoints' mask id instead of reading it
    # from config.json, so a checkpoint with another mask id would denoise with the wrong token
    mask_id = family.engine_mask_ids[ENGINE]
    if model.mask_token_id != mask_id:
        raise ValueError(f"lmdeploy assumes {family.eval_label}'s mask token id {mask_id}; this model's is {model.mask_token_id}")


def _import_lmdeploy():
    try:
        import lmdeploy
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    version = tuple(int(p) for p in lmdeploy.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_VERSION:
        raise ImportError(f"found lmdeploy {lmdeploy.__version__}; {INSTALL_HINT}")
    return lmdeploy


@ENGINES.register("lmdeploy")
class LMDeployEngine:
    """lmdeploy's PyTorch engine on the HF folder `model_path` (the checkpoint `model` was loaded
    from or saved to). Started by the first `generate`; `update_weights` pushes the training
    model's weights into it (lmdeploy serves `update_params` through its ray executor only, hence
    that default even on one GPU)."""

    name = "lmdeploy"

    def __init__(self, model, model_path: str, session_len: Optional[int] = None, cache_max_entry_count: float = 0.5,
                 tp: int = 1, max_batch_size: Optional[int] = None, dtype: str = "auto",
                 distributed_executor_backend: str = "ray", trust_remote_code: bool = True,
                 weight_chunk_bytes: int = 512 * 2**20, **engine_options):
        _import_lmdeploy()
        if not torch.cuda.is_available():
            raise RuntimeError(INSTALL_HINT)
        check_model(model)
        if engine_options.get("enable_prefix_caching"):
            raise ValueError("enable_prefix_caching would reuse KV computed with the previous weights after update_weights")
        self.model, self.model_path = model, str(model_path)
        self.session_len, self.trust_remote_code, self.weight_chunk_bytes = session_len, trust_remote_code, weight_chunk_bytes
        self.engine_options = dict(engine_options, tp=tp, cache_max_entry_count=cache_max_entry_count, max_batch_size=max_batch_size,
                                   dtype=dtype, distributed_executor_backend=distributed_executor_backend)
        self._engine = None
        self._view: Optional[tempfile.TemporaryDirectory] = None  # served_folder's, removed by close()
        self._dllm: Optional[dict] = None
        self._instances: list = []
        self._session_ids = itertools.count(1)
        self._weights_pending = False

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generators: Optional[Sequence[torch.Generator]] = None, record: str = "none",
                 seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        engine_cfg, request_cfg = map_params(params, self.model.block_size, self.model.eos_token_id, record)
        if params.stochastic and generators is None and seeds is None:
            raise ValueError("stochastic sampling needs one torch.Generator (or seed) per prompt")
        seeds = request_seeds(len(prompts), generators, seeds)
        required = required_length([len(p) for p in prompts], params.gen_length, params.block_length)
        self._start(engine_cfg, session_length(required, self.model.max_sequence_length, self.session_len))
        if required > self._engine.max_session_len:
            raise ValueError(f"lmdeploy's KV cache holds sessions of {self._engine.max_session_len} tokens, the batch needs "
                             f"{required}: raise cache_max_entry_count or shorten prompts / gen_length")
        responses = self._run(prompts, request_cfg, seeds)
        return assemble_output(prompts, responses, params, self.model.pad_token_id, self.model.eos_token_id, seeds)

    def update_weights(self, model) -> None:
        """Push `model`'s weights (HF checkpoint names, the ones the engine loaded) before the next
        rollout. Before the engine has started they are pushed right after it loads `model_path`."""
        self.model = model
        if self._engine is None:
            self._weights_pending = True
            return
        if type(getattr(self._engine, "executor", None)).__name__ == "UniExecutor":
            raise RuntimeError("lmdeploy's update_params is not served by its in-process 'uni' executor; "
                               "start the engine with distributed_executor_backend='ray' (the default here)")
        from lmdeploy.serve.openai.protocol import UpdateParamsRequest
        from lmdeploy.utils import serialize_state_dict

        # CUDA IPC handles: the engine's workers map these tensors and copy them into their own weights
        device = torch.device("cuda", torch.cuda.current_device())
        chunks = weight_chunks(model.hf_state_dict(), self.weight_chunk_bytes)
        for i, chunk in enumerate(chunks):
            tensors = {name: t.detach().to(device).contiguous() for name, t in chunk}
            request = UpdateParamsRequest(serialized_named_tensors=serialize_state_dict(tensors), finished=i == len(chunks) - 1)
            self._engine.update_params(request)
            del tensors
        self._weights_pending = False

    def close(self) -> None:
        if self._engine is not None:
            self._instances.clear()
            self._engine.close()
            self._engine = None
        if self._view is not None:
            self._view.cleanup()
            self._view = None

    def _start(self, dllm: dict, session_len: int) -> None:
        if self._engine is not None:
            if dllm != self._dllm:
                raise ValueError(f"lmdeploy fixes the dLLM settings when the engine starts: started with {self._dllm}, "
                                 f"asked for {dllm}; use one sampler per lmdeploy engine")
            return
        from lmdeploy import PytorchEngineConfig
        from lmdeploy.pytorch.engine import Engine

        config = PytorchEngineConfig(session_len=session_len, **self.engine_options, **dllm)
        self._view = tempfile.TemporaryDirectory(prefix="dare-lmdeploy-")
        served = served_folder(Path(self.model_path), Path(self._view.name) / "model")
        self._engine = Engine.from_pretrained(str(served), engine_config=config, trust_remote_code=self.trust_remote_code)
        self._dllm = dict(dllm)
        if self._weights_pending:
            self.update_weights(self.model)

    def _run(self, prompts: Sequence[Sequence[int]], request_cfg: dict, seeds: list) -> list[list[int]]:
        from lmdeploy import GenerationConfig
        from lmdeploy.messages import ResponseType

        ok = (ResponseType.SUCCESS, ResponseType.FINISH)
        # one EngineInstance per in-flight request, as lmdeploy's own async engine does
        while len(self._instances) < len(prompts):
            self._instances.append(self._engine.create_instance())

        async def one(instance, ids: list[int], seed: Optional[int]) -> list[int]:
            session_id = next(self._session_ids)
            tokens: list[int] = []
            try:
                async for out in instance.async_stream_infer(session_id, ids, gen_config=GenerationConfig(**request_cfg, random_seed=seed)):
                    if out.status not in ok:
                        raise RuntimeError(f"lmdeploy request {session_id} failed: {out.status}")
                    tokens.extend(out.token_ids)  # each output carries the new ids only
            finally:
                instance.end(session_id)  # frees its KV blocks (a no-op where the engine already ended it)
            return tokens

        async def run_all() -> list[list[int]]:
            return list(await asyncio.gather(*(one(inst, [int(t) for t in p], s)
                                               for inst, p, s in zip(self._instances, prompts, seeds))))

        return self._instances[0].req_sender.run_until_complete(run_all())
