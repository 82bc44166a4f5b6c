"""A checkpoint folder ready for benchmarks: chat rendering, batched generation and choice
log-likelihoods, with no OpenCompass import (the GPU benchmark and `dare eval`'s core use it
directly; `dare_core.eval.opencompass` wraps it for OpenCompass).

Reproducibility: every prompt's sampling noise and every choice's Monte-Carlo masks come from a
generator derived from (seed, the text itself), never from a global RNG or the batch, so the same
checkpoint and seed give the same numbers at any batch size and in any order.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from dare_core.diffusion.likelihood import elbo_rows
from dare_core.diffusion.mc_laws import count_rows, per_block_rows, response_blocks, uniform_time_rows
from dare_core.diffusion.seeding import generator
from dare_core.models.family import FAMILIES, noise_of
from dare_core.sampling.cache import check_cache_fits
from dare_core.sampling.params import SamplingParams, expand_editing
from dare_core.storage import read_json

Prompt = Union[str, Sequence[dict]]  # raw text, or chat messages [{"role", "content"}]
SAMPLER_KEYS = {f.name for f in fields(SamplingParams)}


def sampler_settings(*layers: Optional[dict]) -> SamplingParams:
    """SamplingParams from dicts applied in order (later wins); keys that are not sampler
    settings (batch_size, engine, ...) are ignored, unknown ones are errors. `editing` (speed |
    quality: `EDITING_MODES`) stands for its settings in its layer, under that layer's own keys."""
    merged: dict = {}
    for layer in layers:
        for key, value in expand_editing(layer or {}).items():
            if key in ("batch_size", "engine", "engine_args"):
                continue
            if key not in SAMPLER_KEYS:
                raise ValueError(f"unknown sampler setting '{key}'; known: {sorted(SAMPLER_KEYS)}")
            merged[key] = value
    try:
        return SamplingParams(**merged)
    except ValueError as exc:
        raise ValueError(f"sampler settings: {exc}") from None


def family_sampler_defaults(model_type: Optional[str]) -> dict:
    """The sampler defaults of the family config.json's `model_type` names (`Family.sampler_defaults`),
    below the checkpoint's own settings; none for a model_type no family has."""
    family = FAMILIES.get(model_type)
    return family.sampler_defaults if family is not None and family.model_type == model_type else {}


def folder_sampler(path: Union[str, Path], block_size: Optional[int], defaults: Optional[dict] = None,
                   sampler: Optional[dict] = None) -> dict:
    """The merged sampler layers of a folder (see EvalModel), before per-call overrides."""
    family = {"block_length": block_size} if block_size else {}
    return {**family, **(defaults or {}), **_checkpoint_sampler(Path(path)), **(sampler or {})}


def _checkpoint_sampler(path: Path) -> dict:
    gen_cfg = path / "generation_config.json"
    if not gen_cfg.exists():
        return {}
    stored = read_json(gen_cfg)
    stored = stored.get("dare_sampler") if isinstance(stored, dict) else None
    return {k: v for k, v in (stored or {}).items() if k in SAMPLER_KEYS}


def model_settings(block_size: Optional[int], *layers: Optional[dict]) -> SamplingParams:
    """`sampler_settings`, also checked against the model: a cache must fit its family (block-KV
    only for block diffusion, prefix/dual only for masked diffusion)."""
    params = sampler_settings(*layers)
    try:
        check_cache_fits(params, block_size is not None)
    except ValueError as exc:
        raise ValueError(f"sampler settings: {exc}") from None
    return params


@dataclass
class FolderCheck:
    """What `check_model_folder` found: the model on the meta device (no weights), its tokenizer,
    and the sampler settings of each benchmark it was given."""

    model: Any
    tokenizer: Any
    settings: dict


def check_model_folder(path: Union[str, Path], sampler: Optional[dict] = None, benchmarks: Optional[dict] = None,
                       defaults: Optional[dict] = None) -> FolderCheck:
    """Everything `EvalModel` would reject about a folder, found without reading its weights:
    config.json, the family, every shard's header, the tokenizer, and the sampler settings (`sampler`
    over the family's defaults and the checkpoint's own, then each of `benchmarks` {name: overrides})."""
    from dare_core.models.hf_folder import inspect_model
    from dare_core.models.tokenizer import load_tokenizer

    model = inspect_model(path)
    tokenizer = load_tokenizer(path)
    if defaults is None:
        defaults = family_sampler_defaults(model.hf_config.get("model_type"))
    base = folder_sampler(path, model.block_size, defaults, sampler)
    settings = {}
    for name, overrides in {None: None, **(benchmarks or {})}.items():
        try:
            settings[name] = model_settings(model.block_size, base, overrides)
        except ValueError as exc:
            raise ValueError(f"{path}{f', benchmark {name!r}' if name else ''}: {exc}") from None
    return FolderCheck(model, tokenizer, settings)


def check_prompt_length(n_tokens: int, gen_length: int, limit: int, which: str) -> None:
    """A prompt and its answer must fit the model's positions (no silent truncation, no failure
    half way through a run)."""
    if n_tokens + gen_length > limit:
        raise ValueError(f"{which} has {n_tokens} tokens (as the model sees it); with gen_length {gen_length} that "
                         f"exceeds the model's max_sequence_length {limit}")


class EvalModel:
    """One model folder evaluated with our sampler.

    Sampler settings, later layers winning: the model's block size (block diffusion), the
    family's `defaults`, the `dare_sampler` the checkpoint was exported with
    (generation_config.json), `sampler` given here, then the per-call `overrides` (a benchmark's gen length and steps, the user's
    per-benchmark settings). `chat`: render chat messages with the tokenizer's chat template
    (False joins their contents, for base models). `family_defaults`: without `defaults`, the
    family's own (`Family.sampler_defaults`, what the OpenCompass classes pass).
    """

    def __init__(self, path: Union[str, Path], sampler: Optional[dict] = None, chat: bool = True, seed: int = 0,
                 dtype: str = "auto", device: Optional[str] = None, batch_size: int = 16, ll_mc_num: int = 32,
                 ll_norm: str = "mean", rows_per_forward: int = 8, engine: str = "native",
                 engine_args: Optional[dict] = None, progress: bool = False, model=None, tokenizer=None,
                 defaults: Optional[dict] = None, family_defaults: bool = False):
        from dare_core.models.hf_folder import inspect_model, load_model
        from dare_core.models.tokenizer import load_tokenizer
        from dare_core.sampling.engines import build_engine
        from dare_core.devices import device as default_device, resolve_dtype

        self.path = Path(path)
        if ll_norm not in ("mean", "sum"):
            raise ValueError(f"ll_norm must be 'mean' (per token) or 'sum', got '{ll_norm}'")
        self.chat, self.seed, self.batch_size = chat, seed, batch_size
        self.ll_mc_num, self.ll_norm, self.rows_per_forward = ll_mc_num, ll_norm, rows_per_forward
        self.progress = progress
        dev = torch.device(device) if device else default_device()
        # everything that can be wrong is found before any weight is read: the folder (config,
        # shard headers), the tokenizer, the sampler settings
        spec = model if model is not None else inspect_model(self.path)
        self.block_size = spec.block_size
        if defaults is None and family_defaults:  # the family's sampler defaults (`Family.sampler_defaults`)
            defaults = family_sampler_defaults(spec.hf_config.get("model_type"))
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.path)
        self.base_sampler = folder_sampler(self.path, self.block_size, defaults, sampler)
        self.sampling_params()  # fail at construction, not on the first benchmark
        self.model = model if model is not None else load_model(self.path, dtype=resolve_dtype(dtype), device=dev)
        self.model.eval()
        self.engine = build_engine(engine, self.model, model_path=str(self.path), **(engine_args or {}))

    # ---- settings
    def sampling_params(self, overrides: Optional[dict] = None) -> SamplingParams:
        return model_settings(self.block_size, self.base_sampler, overrides)

    def manifest(self, overrides: Optional[dict] = None) -> dict:
        """What a number depends on (docs/evaluation.md#reference-numbers): model, sampler, seed, hardware, versions."""
        return {"model": str(self.path), "sampler": asdict(self.sampling_params(overrides)), "seed": self.seed,
                "batch_size": self.batch_size, "dtype": str(next(self.model.parameters()).dtype),
                "engine": self.engine.name, **environment(next(self.model.parameters()).device)}

    # ---- prompts
    def render(self, prompt: Prompt) -> str:
        """The exact text the model sees: raw strings as they are, chat messages through the chat
        template (with the assistant turn opened), or joined when `chat` is off."""
        if isinstance(prompt, str):
            return prompt
        messages = [dict(m) for m in prompt]
        if not self.chat:
            return "\n\n".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _check_lengths(self, ids: Sequence[Sequence[int]], gen_length: int) -> None:
        # before any decoding, so a run does not fail half way through
        for i, x in enumerate(ids):
            check_prompt_length(len(x), gen_length, self.model.max_sequence_length,
                                "the prompt" if len(ids) == 1 else f"prompt {i}")

    def _batches(self, n: int, lengths: Sequence[int]) -> list[list[int]]:
        # longest first, so padding is small and an out-of-memory error shows up in the first batch
        order = sorted(range(n), key=lambda i: -lengths[i])
        return [order[i:i + self.batch_size] for i in range(0, n, self.batch_size)]

    # ---- generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], overrides: Optional[dict] = None, desc: str = "generate") -> list[str]:
        from dare_core.sampling.completions import generate

        params = self.sampling_params(overrides)
        texts = [self.render(p) for p in prompts]
        ids = [self.tokenizer.encode(t) for t in texts]
        self._check_lengths(ids, params.gen_length)
        out: list[Optional[str]] = [None] * len(texts)
        bar = tqdm(total=len(texts), desc=desc, disable=not self.progress, dynamic_ncols=True)
        for batch in self._batches(len(texts), [len(x) for x in ids]):
            seeds = [(self.seed, "eval-generate", texts[i]) for i in batch]
            done = generate(self.engine, self.tokenizer, [ids[i] for i in batch], params, seeds, len(batch))
            for i, text in zip(batch, done.texts):
                out[i] = text
            bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    # ---- log-likelihood (multiple choice)
    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # tokenise the joined text and cut at the context's length, so a merge across the
        # boundary (a leading space) is scored as the model would see it
        ctx = self.tokenizer.encode(context)
        full = self.tokenizer.encode(context + continuation)
        if full[:len(ctx)] == ctx and len(full) > len(ctx):
            return ctx, full[len(ctx):]
        return ctx, self.tokenizer.encode(continuation)

    @torch.no_grad()
    def loglikelihood(self, contexts: Sequence[Prompt], continuations: Sequence[str], desc: str = "loglikelihood") -> list[float]:
        """ELBO estimate of log p(continuation | context) for each pair (docs/diffusion.md#mc-elbo, law (b):
        stratified counts, one uniform subset per row; 2.4 per-block for block diffusion), over
        `ll_mc_num` rows; divided by the continuation's token count when `ll_norm` is "mean". A
        one-token continuation under a masked model is exact: every row masks that token alone. A
        uniform-noise model (DiffusionGemma) scores with its own ELBO at stratified times
        (docs/diffusion.md#uniform-noise-elbo), the continuation filled with EOS to whole canvases."""
        texts = [self.render(c) for c in contexts]
        pairs = [self._split(t, c) for t, c in zip(texts, continuations)]
        out: list[float] = [0.0] * len(pairs)
        bar = tqdm(total=len(pairs), desc=desc, disable=not self.progress, dynamic_ncols=True)
        for batch in self._batches(len(pairs), [len(a) + len(b) for a, b in pairs]):
            for i, value in zip(batch, self._elbo([pairs[i] for i in batch], [texts[i] + continuations[i] for i in batch])):
                out[i] = value
            bar.update(len(batch))
        bar.close()
        return out

    def _elbo(self, pairs: list[tuple[list[int], list[int]]], keys: list[str]) -> list[float]:
        model = self.model
        device = next(model.parameters()).device
        eos = model.eos_token_id
        P = max(len(c) for c, _ in pairs)
        L = max(len(r) for _, r in pairs)
        uniform = noise_of(model) == "uniform"
        if uniform:  # (its canvases are whole: the continuation, then EOS, read but not scored)
            L = -(-L // model.block_size) * model.block_size
        ids = torch.full((len(pairs), P + L), eos, dtype=torch.long)
        attn = torch.zeros(ids.shape, dtype=torch.long)
        valid = torch.zeros((len(pairs), L), dtype=torch.bool)
        for b, (ctx, resp) in enumerate(pairs):
            ids[b, P - len(ctx):P] = torch.tensor(ctx)
            ids[b, P:P + len(resp)] = torch.tensor(resp)
            # (a uniform-noise row reads its own whole canvases, not its batch's: padding after them)
            attn[b, P - len(ctx):P + (-(-len(resp) // model.block_size) * model.block_size if uniform else len(resp))] = 1
            valid[b, :len(resp)] = True
        ids, attn, valid = ids.to(device), attn.to(device), valid.to(device)
        n_tokens = valid.sum(-1).float()
        # a single response token under a masked model: all rows are the same exact term
        exact = model.block_size is None and int(n_tokens.max()) == 1
        rows = 1 if exact else self.ll_mc_num
        gens = [generator(self.seed, "eval-ll", k) for k in keys]
        if uniform:
            corr = uniform_time_rows(ids, P, valid, model.config.vocab_size, rows, gens, tail_fill=eos, canvas=attn[:, P:])
        elif model.block_size is None:
            corr = count_rows(ids, P, valid, valid, model.mask_token_id, rows, gens)
        else:
            blocks = response_blocks(attn, P, model.block_size, "global")
            corr = per_block_rows(ids, P, valid, valid, model.mask_token_id, blocks, rows, gens)
        total = torch.zeros(len(pairs), dtype=torch.float64, device=device)
        for start in range(0, len(corr.rows), self.rows_per_forward):
            chunk = corr.rows[start:start + self.rows_per_forward]
            total += elbo_rows(model, chunk, ids, attn).double().sum(-1)
        elbo = total / len(corr.rows)
        if self.ll_norm == "mean":
            elbo = elbo / n_tokens.clamp_min(1).double().to(device)
        return elbo.tolist()


def environment(device: Optional[torch.device] = None) -> dict:
    """Hardware and software an evaluation ran on (every manifest carries it)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        opencompass = version("opencompass")
    except PackageNotFoundError:
        opencompass = None
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "gpu_count": torch.cuda.device_count(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "opencompass": opencompass}


def load_eval_model(path: Union[str, Path], **options: Any) -> EvalModel:
    """Cached per process and settings: OpenCompass builds a model per task, and reloading an
    8B checkpoint for every benchmark would dominate the run."""
    key = (str(Path(path).resolve()), json.dumps(options, sort_keys=True, default=str))
    if key not in _CACHE:
        _CACHE.clear()  # one model resident at a time
        _CACHE[key] = EvalModel(path, **options)
    return _CACHE[key]


_CACHE: dict = {}
