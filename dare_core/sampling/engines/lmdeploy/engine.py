"""SDAR rollouts through lmdeploy's PyTorch engine, in its own process (docs/sampling.md#engines).

Prompts go in and response token ids come out, never text. What varies per request (temperature,
top-k/top-p, stop ids, length, seed) travels in each request; what lmdeploy fixes when its engine
starts (block length, denoising steps, unmasking strategy, threshold) is set from the first call's
`SamplingParams`, and a later call that differs is refused (`settings.map_params`).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from dare_core.sampling.completions import moved
from dare_core.sampling.decode import GenerationOutput
from dare_core.sampling.engines import ENGINES
from dare_core.sampling.engines.lmdeploy.folder import check_model, served_folder
from dare_core.sampling.engines.lmdeploy.process import EngineProcess, unavailable
from dare_core.sampling.engines.lmdeploy.settings import (assemble_output, map_params, request_seeds, required_length,
                                                          session_length)
from dare_core.sampling.params import SamplingParams

# settings the engine decides itself: one GPU per engine (each rank runs its own), its in-process
# executor (weights come over CUDA IPC, not through lmdeploy's ray executor), no prefix cache (it
# would reuse keys and values computed with the weights before `update_weights`)
FIXED = {"tp": 1, "distributed_executor_backend": "uni", "enable_prefix_caching": False}


@ENGINES.register("lmdeploy")
class LMDeployEngine:
    """lmdeploy's engine on the HF folder `model_path` (the checkpoint `model` was loaded from or
    saved to), started by the first `generate`. `update_weights` pushes the model's weights (LoRA
    merged) into it; weights of `model` that may differ from the folder's (a resumed run, a model
    changed in place) are pushed when it starts, so it always decodes with `model`'s weights."""

    name = "lmdeploy"
    tree_rollouts = False  # a request denoises from its prompt to the end: lmdeploy cannot resume a partial state
    decodes_policy = False  # its own process holds a copy, sent over at each sync

    def __init__(self, model, model_path: Optional[str] = None, python: Optional[str] = None,
                 session_len: Optional[int] = None, cache_max_entry_count: float = 0.5,
                 max_batch_size: Optional[int] = None, dtype: str = "auto", weight_chunk_bytes: int = 512 * 2**20,
                 log_dir: Optional[str] = None, **engine_options):
        check_model(model)
        if model_path is None:
            raise ValueError("the lmdeploy engine starts from a checkpoint folder: give engine_args.model_path")
        reason = unavailable(python)
        if reason:
            raise RuntimeError(reason)
        for key, value in FIXED.items():
            if key in engine_options and engine_options[key] != value:
                raise ValueError(f"lmdeploy engine option {key}={engine_options[key]!r} is not supported; DARE runs it with "
                                 f"{key}={value!r} (one engine process per GPU, weights over CUDA IPC)")
        self.model, self.model_path, self.python = model, str(model_path), python
        self.session_len, self.weight_chunk_bytes, self.log_dir = session_len, weight_chunk_bytes, log_dir
        self.engine_options = dict(engine_options, **FIXED, cache_max_entry_count=cache_max_entry_count,
                                   max_batch_size=max_batch_size, dtype=dtype)
        self.process: Optional[EngineProcess] = None
        self.info: dict = {}  # what the started engine reported (versions, device, session length)
        self.last_sync: dict = {}  # the last weight push: tensors, buckets, seconds
        self._view: Optional[tempfile.TemporaryDirectory] = None
        self._dllm: Optional[dict] = None
        # a model with real weights may differ from its folder's; a meta model (a bench's) has none
        self._weights_pending = any(p.device.type != "meta" for p in model.parameters())

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why it cannot run here (None: it can), for the default engine python."""
        return unavailable()

    @staticmethod
    def check(model, params: SamplingParams, record: str = "none") -> None:
        """ValueError for a model or settings this engine cannot decode (`build_engine`'s caller can
        ask before loading any weight: engines.check_engine)."""
        check_model(model)
        map_params(params, model.block_size, model.eos_token_id, record)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generators: Optional[Sequence[torch.Generator]] = None, record: str = "none",
                 seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        engine_cfg, request = map_params(params, self.model.block_size, self.model.eos_token_id, record)
        if params.stochastic and generators is None and seeds is None:
            raise ValueError("stochastic sampling needs one torch.Generator (or seed) per prompt")
        seeds = request_seeds(len(prompts), generators, seeds)
        required = required_length([len(p) for p in prompts], params.gen_length, params.block_length)
        self.start(engine_cfg, session_length(required, self.model.max_sequence_length, self.session_len))
        if required > self.info["max_session_len"]:
            raise ValueError(f"lmdeploy's KV cache holds sessions of {self.info['max_session_len']} tokens, the batch needs "
                             f"{required}: raise cache_max_entry_count or shorten prompts / gen_length")
        responses = self.process.call("generate", prompts=[[int(t) for t in p] for p in prompts], request=request, seeds=seeds)
        out = assemble_output(prompts, responses, params, self.model.pad_token_id, self.model.eos_token_id, seeds)
        # on the policy's device, as our loop returns them (the trainer scores them there); a bench's
        # meta model has no device for them
        device = next(self.model.parameters()).device
        return out if device.type == "meta" else moved(out, device)

    def update_weights(self, model) -> None:
        """Push `model`'s weights (checkpoint names, LoRA merged) before the next rollout; before the
        engine has started, right after it loads `model_path`."""
        self.model = model
        if self.process is None:
            self._weights_pending = True
            return
        with torch.no_grad():
            self.last_sync = self.process.push_weights(model.hf_tensors(), self.weight_chunk_bytes)
        self._weights_pending = False

    def start(self, dllm: dict, session_len: int) -> None:
        """Start the engine process with the dLLM settings `dllm` (once; later calls must match)."""
        if self.process is not None:
            if dllm != self._dllm:
                raise ValueError(f"lmdeploy fixes the dLLM settings when the engine starts: started with {self._dllm}, "
                                 f"asked for {dllm}; use one sampler per lmdeploy engine")
            return
        t0 = time.perf_counter()
        self._view = tempfile.TemporaryDirectory(prefix="dare-lmdeploy-view-")
        served = served_folder(Path(self.model_path), Path(self._view.name) / "model", self.model.mask_token_id,
                               self.model.pad_token_id)
        self.process = EngineProcess(self.python, self.log_dir)
        try:
            self.info = self.process.call("start", model_path=str(served),
                                          engine_config=dict(self.engine_options, session_len=session_len, **dllm))
        except BaseException:
            self.close()
            raise
        self._dllm = dict(dllm)
        self.info["start_seconds"] = time.perf_counter() - t0
        if self._weights_pending:
            self.update_weights(self.model)

    def probe(self, on: bool = True) -> None:
        """Record lmdeploy's logits of every forward from now on (`take_records`), for parity checks."""
        if self.process is None:
            raise RuntimeError("the lmdeploy engine has not started: generate once first")
        self.process.call("probe", on=on)

    def take_records(self) -> list[dict]:
        return self.process.call("take_records")

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None
        if self._view is not None:
            self._view.cleanup()
            self._view = None
