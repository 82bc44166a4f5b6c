"""Training steps of the real stage loops on one GPU, at the LLaDA-8B and SDAR-8B shapes.

    python3 bench/train_step.py                                   # everything (GPU): ~19 min on an H100
    python3 bench/train_step.py --parts sft                       # one part (~5.5 min); --add keeps
    python3 bench/train_step.py --parts rl --add                  #   (~7 min) the rows of earlier runs
    python3 bench/train_step.py --parts rl-public --add           #   (~7 min) of this commit and settings
    python3 bench/train_step.py --tiny --workdir /tmp/t --out /tmp/t/train_step.md   # CPU smoke run

Each invocation rewrites --out (default bench/results/train_step.md) and its JSON twin, which holds
the measured rows; with --add the rows of the JSON already there are kept, so parts run by
separate commands (each under a 10-minute limit, say) end up in one file. Measured on an H100 at
LLaDA-8B: writing the folder 20 s, the LoRA SFT pair 2.5 min, the DARE RL run 3.2 min, the public
recipe over 5 min (its rollout alone); full-parameter SFT is skipped with its reason there.

What runs: `run_sft` / `run_rl` themselves (DeepSpeed engine, optimizer, gradient accumulation;
checkpoints and, except where export is timed, the final export off), with phase timing on
(`dare_core.timing`), each in a child process of its own so that every run starts with an
empty GPU, its peak memory is its own, and a run killed for memory is recorded instead of ending
the bench. The config is params.yaml with overrides (`load_config`), as a stage reads it.

The model: for each shape, a checkpoint folder in the real on-disk layout (the real config.json of
bench/configs, the reference index's parameter names, checked, shards up to the size of the
reference's largest), written once per work folder by DARE's own `save_model` from a model built on
the GPU in bf16 and filled with random values there, then loaded by every stage through
`model.path`, as a downloaded checkpoint would be. Its tokenizer covers the model's whole
vocabulary: printable characters (one token each), EOS and MASK at the config's ids, and a
placeholder token for every other id, so token ids match the config and any sampled id decodes.

Parts:
  sft          LoRA SFT (r 32, alpha 16, gradient checkpointing), packed vs padded, and (--compile-shapes)
               packed with `model.compile: true`
  sft-full     full-parameter SFT, ZeRO-3 with the optimizer state on the CPU, packed vs padded
               (not run, with the reason, when the host memory cannot hold the optimizer state)
  rl           one d1 step: 16 prompts x 8 rollouts, gen 256, dual cache (SDAR: block_kv) and CUDA
               graphs, packed training, a synthetic reward keyed on the response tokens
  rl-public    the same step as the public d1 recipe computes it: rollouts without a cache, the
               whole canvas re-encoded every step, float64 Gumbel-max sampling and softmax (the
               `reference` mode of bench/rollout.py, sampled as d1 does), eager; training padded,
               with logits over the whole canvas
Start-up (stage start to its first step) and the merged LoRA export are measured in the runs; so is
the time from spawning a run's process to the stage's start (interpreter, imports, config), shown
beside it because a user's `dare stage` command pays it too.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from stamp import git_commit, library_versions  # noqa: E402

CONFIGS = REPO / "bench" / "configs"
SHAPES = {"llada": "LLaDA-8B-Instruct", "sdar": "SDAR-8B-Chat"}
FAMILIES = {"llada": "llada", "sdar": "sdar"}
PARTS = ("sft", "sft-full", "rl", "rl-public")
REWARD = "bench_token_hash"
PUBLIC = "bench_public_d1"  # the public recipe's rollout engine and algorithm, registered by this file

# --tiny: the same configs shrunk to two narrow layers, a 256-token vocabulary (ids moved inside it)
TINY_SIZES = {
    "n_layers": 2, "d_model": 64, "mlp_hidden_size": 128, "n_heads": 4, "n_kv_heads": 4,
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "embedding_size": 256,
}
TINY_IDS = {"eos_token_id": 250, "pad_token_id": 250, "bos_token_id": 250, "mask_token_id": 251}


@dataclass
class Settings:
    """Batch shapes and step counts of every run (the GPU defaults; `tiny()` shrinks them)."""

    sft_min_len: int = 72  # real length of an SFT sequence (LLaDA: prompt + canvas), uniform in [min, max]
    sft_max_len: int = 1024
    sft_pad_to: int = 64  # the response canvas (sft.pad_to); responses fill 1/4 to all of it
    sft_micro: int = 16
    sft_accum: int = 2
    sft_warmup: int = 1  # steps run before the timed ones (allocator, kernels, FlexAttention compile)
    sft_steps: int = 3
    sft_lora: tuple = (32, 16)  # r, alpha
    rl_prompts: int = 16
    rl_group: int = 8
    rl_gen: int = 256
    rl_block: int = 32  # LLaDA; SDAR decodes in its own block size (4)
    rl_denoise_steps: int = 128  # 2 tokens per step, d1's setting
    rl_prompt_min: int = 64
    rl_prompt_max: int = 192
    rl_micro: int = 16
    rl_iterations: int = 2  # > 1, so the old policy is scored
    rl_kl: float = 0.04  # > 0, so the reference policy (the adapter disabled) is scored
    rl_temperature: float = 0.9
    rl_lora: tuple = (128, 64)  # d1's adapter
    rl_steps: int = 2  # DARE's step is timed at the last one (the first captures graphs, compiles)
    rl_public_steps: int = 1  # nothing to warm up: no graphs, nothing compiled
    # DARE: rollouts per sampler batch: all 128 at once (one KV cache: about 30 GB at LLaDA-8B)
    rollout_batch: int = 128
    public_chunk: int = 16  # public recipe: rollouts per generate call (its float64 tensors are [chunk, S, V])

    def with_overrides(self, items: list[str]) -> "Settings":
        """`name=value` pairs (`--set rollout_batch=128 sft_lora=16,8`), typed like the defaults."""
        changes = {}
        for item in items:
            name, sep, value = item.partition("=")
            current = getattr(self, name, None)
            if not sep or current is None:
                names = [f.name for f in dataclasses.fields(self)]
                raise ValueError(f"--set {item}: expected name=value with a name of {names}")
            changes[name] = tuple(int(v) for v in value.split(",")) if isinstance(current, tuple) else type(current)(value)
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls) -> "Settings":
        return cls(sft_min_len=16, sft_max_len=48, sft_pad_to=8, sft_micro=4, sft_accum=2, sft_steps=1, sft_lora=(4, 8),
                   rl_prompts=4, rl_group=4, rl_gen=16, rl_block=8, rl_denoise_steps=8, rl_prompt_min=8, rl_prompt_max=16,
                   rl_micro=8, rl_lora=(4, 8), rollout_batch=16, public_chunk=8)


# --------------------------------------------------------------------------- the model folder


def shape_config(shape: str, tiny: bool) -> dict:
    """The real config.json of the shape (shrunk under --tiny)."""
    cfg = json.loads((CONFIGS / f"{SHAPES[shape]}.json").read_text())
    if tiny:
        cfg.update({k: v for k, v in TINY_SIZES.items() if k in cfg})
        cfg.update({k: v for k, v in TINY_IDS.items() if k in cfg or k == "mask_token_id"})
    return cfg


def bench_tokenizer(hf_config: dict):
    """A tokenizer over the model's whole vocabulary whose special ids are the config's: printable
    characters at ids 0..99 (so a text of n characters is n tokens), EOS (also padding) and MASK at
    the config's ids, and a placeholder `<|t{id}|>` at every other id (random weights sample any id,
    and the reward reads the decoded text)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from dare_core.models.tokenizer import CHARS, EOS, MASK, Tokenizer

    vocab_size = hf_config.get("embedding_size") or hf_config["vocab_size"]
    specials = {hf_config["eos_token_id"]: EOS, hf_config["mask_token_id"]: MASK}
    if min(specials) < len(CHARS):
        raise ValueError(f"special ids {sorted(specials)} collide with the {len(CHARS)} character ids")
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab.update({specials.get(i, f"<|t{i}|>"): i for i in range(len(CHARS), vocab_size)})
    backend = Backend(models.WordLevel(vocab, unk_token=EOS))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (EOS, MASK)])
    config = {"eos_token": EOS, "pad_token": EOS, "mask_token": MASK, "tokenizer_class": "PreTrainedTokenizerFast",
              "clean_up_tokenization_spaces": False, "model_max_length": int(1e30)}
    return Tokenizer(backend, config)


def reference_index(shape: str) -> dict:
    """The weight map of the real checkpoint (copied from its public release)."""
    return json.loads((CONFIGS / f"{SHAPES[shape]}.safetensors.index.json").read_text())["weight_map"]


def largest_reference_shard(shape: str) -> int:
    """Bytes of the real checkpoint's largest shard (bf16), from its index and the config's shapes."""
    from dare_core.models.lm import build_model

    shapes = build_model(shape_config(shape, tiny=False), device="meta").hf_parameter_shapes()
    sizes: dict[str, int] = {}
    for name, shard in reference_index(shape).items():
        sizes[shard] = sizes.get(shard, 0) + 2 * math.prod(shapes[name])
    return max(sizes.values())


def write_model_folder(shape: str, folder: Path, tiny: bool) -> dict:
    """The shape's checkpoint folder: random bf16 weights drawn on the device, saved by `save_model`
    with the tokenizer; checks that its parameter names are the reference index's."""
    from dare_core.models.lm import empty_model
    from dare_core.models.hf_folder import save_model

    hf_config = shape_config(shape, tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = empty_model(hf_config, device=device, dtype=torch.bfloat16)
    model.net.init_weights(torch.Generator(device).manual_seed(0))
    names = set(model.hf_parameter_shapes())
    real = set(reference_index(shape))
    # --tiny keeps two layers: its names are a subset of the real ones
    if (names - real) or (not tiny and names != real):
        raise RuntimeError(f"{SHAPES[shape]}: parameter names differ from the reference index: "
                           f"{sorted(names ^ real)[:4]}")
    tok_dir = folder.parent / "tokenizer"
    bench_tokenizer(hf_config).save(tok_dir)
    t1 = time.perf_counter()
    save_model(model, folder, max_shard_bytes=largest_reference_shard(shape), extra_files={"tokenizer": tok_dir})
    out = {"params": sum(p.numel() for p in model.parameters()), "init_s": t1 - t0, "save_s": time.perf_counter() - t1,
           "files": len(list(folder.glob("*.safetensors"))), "hardware": hardware()}
    # the caller goes on to start the runs' own processes on this GPU: the allocator's cache of these
    # weights (16 GiB at 8B) would be held from them
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def evict_page_cache(folder: Path) -> None:
    """Drop the folder's files from the OS page cache, so that a stage reads them from the disk, as
    a fresh download would be read after a reboot (best effort: where the OS has no fadvise, warm)."""
    if hasattr(os, "posix_fadvise"):
        from startup_export import drop_from_cache

        drop_from_cache(folder)


# --------------------------------------------------------------------------- data


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n - 1)) + "."


def write_data(folder: Path, s: Settings, seed: int = 0) -> None:
    """sft.parquet (lengths uniform in [sft_min_len, sft_max_len]), rl.parquet (exactly one step's
    prompts, so every step trains on the same batch) and a small val.parquet, in the prepared schema."""
    from dare_core.data.schema import write_rows

    rng = random.Random(seed)
    n_sft = (s.sft_warmup + s.sft_steps) * s.sft_micro * s.sft_accum
    sft = []
    for i in range(n_sft):
        prompt = _text(rng, rng.randint(s.sft_min_len, s.sft_max_len) - s.sft_pad_to)
        response = _text(rng, rng.randint(s.sft_pad_to // 4, s.sft_pad_to - 1))
        sft.append({"prompt": prompt, "prompt_text": prompt, "response": response, "task": "bench", "uid": f"sft-{i}"})
    rl = []
    for i in range(s.rl_prompts + 2):
        prompt = _text(rng, rng.randint(s.rl_prompt_min, s.rl_prompt_max))
        rl.append({"prompt": prompt, "prompt_text": prompt, "ground_truth": "0", "task": "bench", "uid": f"rl-{i}"})
    write_rows(folder / "sft.parquet", sft, "sft")
    write_rows(folder / "rl.parquet", rl[:s.rl_prompts], "rl")
    write_rows(folder / "val.parquet", rl[s.rl_prompts:], "val")


# --------------------------------------------------------------------------- the RL pieces


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


class PublicRecipeSampler:
    """Rollouts as the public LLaDA sampler (and d1's copy of it) computes them: every step
    re-encodes the whole canvas and takes logits at every position (no cache), samples by float64
    Gumbel-max, scores confidence with a float64 softmax over the full vocabulary, and commits the
    top-k masked positions of the current block, row by row. bench/rollout.py's `reference` mode
    is the same loop, greedy."""

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
        mask_id = model.mask_token_id
        device = next(model.parameters()).device
        canvas = Canvas.build(prompts, params, mask_id, model.pad_token_id, model.block_size is not None, device)
        x, s, nfe = canvas.x, params.steps_per_block, 0
        for lo, hi in canvas.blocks:
            m0 = (x[:, lo:hi] == mask_id).sum(-1)
            for j in range(s):
                logits = model(x, canvas.attn)
                x0 = gumbel_max(logits, params.temperature)
                p = torch.softmax(logits.to(torch.float64), dim=-1)
                conf = p.gather(-1, x0[..., None]).squeeze(-1)
                conf[:, :lo] = -math.inf
                conf[:, hi:] = -math.inf
                conf = torch.where(x == mask_id, conf, torch.full_like(conf, -math.inf))
                k = m0 // s + (j < m0 % s).long()
                for b in range(x.shape[0]):
                    idx = conf[b].topk(int(k[b])).indices
                    x[b, idx] = x0[b, idx]
                nfe += 1
        cols = canvas.resp_start[:, None] + torch.arange(params.gen_length, device=device)
        response = x.gather(1, cols)
        response = response.masked_fill(response == mask_id, model.eos_token_id)
        stop_ids = torch.tensor(sorted({model.eos_token_id, *params.stop_token_ids}))
        steps = torch.full((len(prompts),), len(canvas.blocks) * s)
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
    """The synthetic reward, and the public recipe's sampler and estimator, by name (once)."""
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


# --------------------------------------------------------------------------- full-parameter training


def optimizer_host_bytes(n_params: int) -> int:
    """Host memory of ZeRO-3's CPU optimizer: fp32 weights, gradients and two Adam moments."""
    return 16 * n_params


def host_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------- one run (child process)


def stage_config(spec: dict):
    """params.yaml with the run's overrides, read as a stage reads it."""
    from dare_core.config import load_config

    overrides = [f"{key}={json.dumps(value)}" for key, value in spec["overrides"].items()]
    return load_config(REPO / "params.yaml", overrides)


def common_overrides(spec: dict) -> dict:
    root = Path(spec["workdir"])
    name = spec["name"]
    return {
        "run.name": name, "run.seed": 0, "run.runs_dir": str(root / "runs"), "run.models_dir": str(root / "models"),
        "run.metrics_dir": str(root / "runs" / name / "metrics"), "data.prepared_dir": spec["data"],
        "data.tokenizer_dir": spec["folder"], "model.path": spec["folder"], "model.family": FAMILIES[spec["shape"]],
        "model.gradient_checkpointing": True, "model.dtype": "auto",
    }


def sft_overrides(spec: dict, s: Settings) -> dict:
    lora = {"r": s.sft_lora[0], "alpha": s.sft_lora[1]} if spec["training"] == "lora" else None
    return {
        **common_overrides(spec), "model.packing": spec["packing"], "model.compile": spec.get("compile", False), "model.lora": lora,
        # full parameters: ZeRO-3 with the optimizer on the CPU (DeepSpeedCPUAdam): the fp32 master
        # weights, gradients and Adam moments of a full 8B model (16 bytes a parameter) do not fit one GPU
        "launch.zero_stage": 0 if lora else 3, "launch.offload_optimizer": "none" if lora else "cpu",
        "sft.max_steps": s.sft_warmup + s.sft_steps, "sft.micro_batch_size": s.sft_micro, "sft.grad_accum": s.sft_accum,
        "sft.pad_to": s.sft_pad_to, "sft.log_every": 1, "sft.save_every": 10**9,
        "sft.optim": {"lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
    }


def rl_overrides(spec: dict, s: Settings, block_size: Optional[int]) -> dict:
    public = spec["recipe"] == "public"
    algorithm = PUBLIC if public else "d1"
    cuda = torch.cuda.is_available()
    sampler = {
        "gen_length": s.rl_gen, "steps": s.rl_denoise_steps, "block_length": block_size or s.rl_block,
        "temperature": s.rl_temperature, "cache": "none" if public else ("block_kv" if block_size else "dual"),
        "cuda_graphs": None if public or not cuda else True, "compile_forward": cuda and not public,
        "engine": PUBLIC if public else "native",
        "batch_size": s.public_chunk if public else s.rollout_batch,
    }
    return {
        **common_overrides(spec), "model.packing": "off" if public else "on",
        "model.lora": {"r": s.rl_lora[0], "alpha": s.rl_lora[1]}, "launch.zero_stage": 0,
        "rl.algorithm": algorithm, "rl.algorithm_args": {algorithm: {"p_mask_prompt": 0.15}}, "rl.reward": REWARD,
        "rl.num_steps": s.rl_public_steps if public else s.rl_steps, "rl.prompts_per_step": s.rl_prompts,
        "rl.group_size": s.rl_group, "rl.num_iterations": s.rl_iterations, "rl.mini_batches": 1,
        "rl.micro_batch_size": s.rl_micro, "rl.adv_estimator": "grpo", "rl.kl_beta": s.rl_kl, "rl.sampler": sampler,
        "rl.optim": {"lr": 1e-6}, "rl.validate_every": 0, "rl.log_every": 1, "rl.save_every": 10**9,
    }


def metrics_rows(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def sft_step_work(cfg, world: int = 1) -> list[dict]:
    """Per step: real and padded tokens, and the model FLOPs of the useful work (bench/model_throughput.py's
    model) of all `world` ranks together, rebuilt with the loop's own batching from the same data order."""
    from model_throughput import model_flops

    from dare_core.data.batching import balanced_micro_batches, global_batch_indices, sft_batch
    from dare_core.data.schema import read_rows
    from dare_core.models.hf_folder import inspect_model
    from dare_core.training.setup import stage_tokenizer
    from dare_core.training.sft_loop import encode_sft_rows, sft_row_cost

    rows = read_rows(Path(cfg.data.prepared_dir) / "sft.parquet", "sft")
    prompts, responses = encode_sft_rows(rows, stage_tokenizer(cfg))
    model = inspect_model(cfg.model.path)
    sc = cfg.sft
    global_batch = sc.micro_batch_size * sc.grad_accum * world
    cost = sft_row_cost(prompts, responses, sc.pad_to, model.block_size is None)
    work = []
    for step in range(sc.max_steps):
        idx = global_batch_indices(step, global_batch, len(rows), cfg.run.seed)
        padded, lens, rank_tokens = 0, [], [0] * world
        for k, m in enumerate(balanced_micro_batches(idx, cost, sc.micro_batch_size)):
            b = sft_batch([prompts[i] for i in m], [responses[i] for i in m], [rows[i]["uid"] for i in m], sc.pad_to,
                          model.eos_token_id, model.pad_token_id, eos_padding=model.block_size is None)
            lens += b.attention_mask.sum(-1).tolist()
            padded += b.attention_mask.numel()
            rank_tokens[k % world] += int(b.attention_mask.sum())  # the loop's micro[rank::world]
        # block diffusion trains through the two-stream layout [x_t ; x_0]: its forward runs every
        # real token twice
        flops = model_flops(model, [2 * n for n in lens] if model.block_size else lens, backward=True)
        work.append({"real_tokens": sum(lens), "padded_tokens": padded, "sequences": len(lens), "flops": flops,
                     "rank_tokens": rank_tokens})
    return work


def run_sft_task(spec: dict, s: Settings) -> dict:
    from dare_core.training.sft_loop import run_sft

    cfg = stage_config({**spec, "overrides": sft_overrides(spec, s)})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    launch = time.time() - spec["spawned_at"]
    summary = run_sft(cfg, progress=False, save_checkpoints=False, export=spec["export"], phase_times=True)
    out = {"summary": summary, "metrics": metrics_rows(cfg.stage_dir("sft")), "work": sft_step_work(cfg), "launch_s": launch}
    shutil.rmtree(cfg.stage_dir("sft") / "model", ignore_errors=True)  # 16 GB of the disk
    return out


def run_rl_task(spec: dict, s: Settings) -> dict:
    from dare_core.models.hf_folder import inspect_model
    from dare_core.training.rl_loop import rl_start_folder, run_rl

    register_rl_pieces()
    block_size = inspect_model(spec["folder"]).block_size
    cfg = stage_config({**spec, "overrides": rl_overrides(spec, s, block_size)})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    # RL starts from the SFT stage's export: here, the shape's folder itself
    start = rl_start_folder(cfg)
    start.parent.mkdir(parents=True)
    start.symlink_to(spec["folder"], target_is_directory=True)
    launch = time.time() - spec["spawned_at"]
    summary = run_rl(cfg, progress=False, save_checkpoints=False, phase_times=True)
    return {"summary": summary, "metrics": metrics_rows(cfg.stage_dir("rl")), "launch_s": launch}


def run_task(spec: dict) -> dict:
    s = Settings(**spec["settings"])
    if spec["kind"] == "folder":
        return write_model_folder(spec["shape"], Path(spec["folder"]), spec["tiny"])
    if spec["kind"] == "sft":
        return run_sft_task(spec, s)
    return run_rl_task(spec, s)


def task_main(spec_path: Path) -> int:
    """A child: run one task, write its result (or its error) next to the spec."""
    spec = json.loads(spec_path.read_text())
    result_path = spec_path.with_suffix(".result.json")
    try:
        result = run_task(spec)
        result.update(hardware=hardware(), peak_flops=peak_bf16())
    except Exception as exc:  # recorded in the results file: a bench reports what failed, and goes on
        traceback.print_exc()
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            result = {"error": f"out of GPU memory ({str(exc).splitlines()[0][:160]})"}
        else:
            result = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result_path.write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- the parent: plan, run, report


def hardware() -> str:
    import importlib.metadata as md

    try:
        ds = md.version("deepspeed")
    except md.PackageNotFoundError:
        ds = "absent"
    cpu = f"{os.cpu_count()} CPU cores, {host_memory_bytes() / 2**30:.0f} GiB RAM"
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
        return f"{gpu}, {cpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, DeepSpeed {ds}"
    return f"CPU only ({platform.machine()}), {cpu}, torch {torch.__version__}, DeepSpeed {ds}"


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # the interpreter's own tools first (ninja for DeepSpeed's JIT ops), as the stage commands run
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


class Runner:
    """Runs tasks in child processes, logs each to the work folder, returns their results."""

    def __init__(self, workdir: Path, timeout: Optional[float], verbose: bool):
        self.dir = workdir / "tasks"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timeout, self.verbose = timeout or None, verbose

    def __call__(self, name: str, spec: dict) -> dict:
        spec_path = self.dir / f"{name}.json"
        result_path = spec_path.with_suffix(".result.json")
        log_path = spec_path.with_suffix(".log")
        result_path.unlink(missing_ok=True)
        spec_path.write_text(json.dumps({**spec, "spawned_at": time.time()}))
        print(f"[train_step] {name} ...", flush=True)
        t0 = time.perf_counter()
        with log_path.open("w") as log:
            try:
                proc = subprocess.run([sys.executable, __file__, "--task", str(spec_path)], env=child_env(), cwd=REPO,
                                      stdout=None if self.verbose else log, stderr=subprocess.STDOUT, timeout=self.timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
        wall = time.perf_counter() - t0
        if result_path.exists():
            result = json.loads(result_path.read_text())
        elif code is None:
            result = {"error": f"stopped after the {self.timeout:.0f} s task limit"}
        elif code < 0:
            result = {"error": f"killed by signal {-code}" + (" (host out of memory?)" if -code == 9 else "")}
        else:
            result = {"error": f"exited with code {code}, no result (see {log_path})"}
        result["wall_s"] = wall
        status = result.get("error", "ok")
        print(f"[train_step] {name}: {status} ({wall:.0f} s)", flush=True)
        if "error" in result and not self.verbose:
            print("".join(log_path.read_text().splitlines(keepends=True)[-25:]), flush=True)
        return result


def mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def sft_row(shape: str, training: str, packing: str, result: dict, s: Settings, compiled: bool = False) -> dict:
    row = {"part": "sft" if training == "lora" else "sft-full", "shape": shape, "training": training, "packing": packing,
           "compile": compiled, "hardware": result.get("hardware")}
    if "error" in result:
        return {**row, "error": result["error"]}
    steps = [m for m in result["metrics"] if "time/step_s" in m]
    timed = steps[s.sft_warmup:]
    work = result["work"][s.sft_warmup:]
    seconds = sum(m["time/step_s"] for m in timed)
    row.update(
        steps=len(timed), sequences=mean([w["sequences"] for w in work]),
        real_tokens=mean([w["real_tokens"] for w in work]), padded_tokens=mean([w["padded_tokens"] for w in work]),
        step_s=seconds / len(timed), fwd_bwd_s=mean([m.get("time/forward_backward_s") for m in timed]),
        optimizer_s=mean([m.get("time/optimizer_s") for m in timed]),
        tokens_per_s=sum(w["real_tokens"] for w in work) / seconds,
        mfu=sum(w["flops"] for w in work) / seconds / result["peak_flops"] if result["peak_flops"] else None,
        peak_gib=max((m["memory/peak_gib"] for m in timed if "memory/peak_gib" in m), default=None),
        **startup(steps, result),
        export_s=next((m["time/export_s"] for m in result["metrics"] if "time/export_s" in m), None),
        export_parts=next(({k: m.get(f"time/export_{k}_s") for k in EXPORT_PHASES} for m in result["metrics"] if "time/export_s" in m), {}),
        loss=steps[-1].get("loss") if steps else None,
    )
    return row


RL_PHASES = ("rollout", "reward", "scoring", "forward_backward", "optimizer")
STARTUP_PHASES = ("checks", "load", "engine")
EXPORT_PHASES = ("produce", "copy", "disk_wait", "other")  # merging the adapter in, copying off the GPU, waiting for the disk, opening and closing files


def startup(steps: list[dict], result: dict) -> dict:
    """Start-up seconds and their phases, from the first logged step."""
    first = steps[0] if steps else {}
    return {"startup_s": first.get("time/startup_s"), "launch_s": result.get("launch_s"),
            "startup_parts": {p: first.get(f"time/startup_{p}_s") for p in STARTUP_PHASES}}


def rl_row(shape: str, recipe: str, result: dict) -> dict:
    row = {"part": "rl" if recipe == "dare" else "rl-public", "shape": shape, "recipe": recipe, "hardware": result.get("hardware")}
    if "error" in result:
        return {**row, "error": result["error"]}
    steps = [m for m in result["metrics"] if "time/step_s" in m]
    last = steps[-1]
    row.update({p: last.get(f"time/{p}_s", 0.0) for p in RL_PHASES})
    row.update(step=last["step"], step_s=last["time/step_s"], **startup(steps, result),
               zero_std_ratio=last.get("zero_std_ratio"), reward_std=last.get("reward_std"),
               peak_gib=last.get("memory/peak_gib"), response_tokens=last.get("response_tokens"))
    row["other"] = row["step_s"] - sum(row[p] for p in RL_PHASES)
    return row


def peak_bf16() -> Optional[float]:
    """Peak dense bf16 FLOP/s of this GPU (bench/model_throughput.py's table); None on the CPU."""
    if not torch.cuda.is_available():
        return None
    from model_throughput import PEAK_BF16

    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), 989e12)


class Rows(list):
    """The rows measured so far; each one added rewrites the results file, so a run stopped by a
    time limit still leaves what it measured (its file says which runs it has)."""

    def __init__(self, save: Callable[[list[dict]], None]):
        super().__init__()
        self.save = save

    def append(self, row: dict) -> None:
        super().append(row)
        self.save(list(self))

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self


def run_shape(shape: str, parts: list[str], args, s: Settings, runner: Runner, rows: list[dict]) -> list[dict]:
    """Every selected run at one shape, on its folder (written first if this work folder lacks it)."""
    base = Path(args.workdir) / ("tiny" if args.tiny else "8b") / shape
    folder, data = base / "model", base / "data"
    if not (folder / "config.json").exists():
        result = runner(f"{shape}-folder", {"kind": "folder", "shape": shape, "folder": str(folder), "tiny": args.tiny,
                                            "settings": dataclasses.asdict(s)})
        rows.append({"part": "folder", "shape": shape, **result})
        if "error" in result:
            return rows
    data.mkdir(parents=True, exist_ok=True)
    write_data(data, s)
    spec = {"shape": shape, "folder": str(folder), "data": str(data), "workdir": str(base), "tiny": args.tiny,
            "settings": dataclasses.asdict(s)}

    def run(name: str, **extra) -> dict:
        if args.cold:
            evict_page_cache(folder)
        return runner(f"{shape}-{name}", {**spec, "name": name, **extra})

    if "sft" in parts:
        variants = [("on", False), ("off", False)] + ([("on", True)] if shape in args.compile_shapes else [])
        for packing, compiled in variants:
            name = f"sft-lora-{packing}" + ("-compile" if compiled else "")
            result = run(name, kind="sft", training="lora", packing=packing, compile=compiled,
                         export=packing == "on" and not compiled)
            rows.append(sft_row(shape, "lora", packing, result, s, compiled))
    if "sft-full" in parts:
        rows += full_parameter_rows(shape, folder, args, s, run)
    if "rl" in parts:
        rows.append(rl_row(shape, "dare", run("rl-dare", kind="rl", recipe="dare")))
    if "rl-public" in parts and shape in args.public_shapes:
        rows.append(rl_row(shape, "public", run("rl-public", kind="rl", recipe="public")))
    return rows


def full_parameter_rows(shape: str, folder: Path, args, s: Settings, run) -> list[dict]:
    """Full-parameter SFT packed and padded, or why it cannot run here."""
    from dare_core.models.hf_folder import inspect_model

    n = sum(p.numel() for p in inspect_model(folder).parameters())
    need, have = optimizer_host_bytes(n), host_memory_bytes()
    if args.full_param == "auto" and have and need > 0.9 * have:
        why = (f"not run: ZeRO-3 with the optimizer on the CPU needs about {need / 2**30:.0f} GiB of host memory "
               f"for {n / 1e9:.2f} B parameters (fp32 weights, gradients and two Adam moments, 16 bytes each), "
               f"this machine has {have / 2**30:.0f} GiB; on the GPU alone they would take {need / 2**30:.0f} GiB "
               f"beside the bf16 weights (--full-param run tries anyway)")
        return [{"part": "sft-full", "shape": shape, "training": "full", "packing": p, "error": why} for p in ("on", "off")]
    return [sft_row(shape, "full", p, run(f"sft-full-{p}", kind="sft", training="full", packing=p, export=False), s)
            for p in ("on", "off")]


# --------------------------------------------------------------------------- the results file


def fmt(value, spec: str = ".2f") -> str:
    return "" if value is None else f"{value:{spec}}"


def same_run(a: dict, b: dict) -> bool:
    """Ratios are taken between rows of one invocation only (a merged file holds several): two runs
    differ in machine state and, possibly, commit."""
    return a.get("run") == b.get("run")


def sft_table(rows: list[dict]) -> list[str]:
    lines = ["| run | model | training | packing | sequences / step | real tokens / step | padded tokens / step | s / step | "
             "fwd+bwd s | optimizer s | tokens/s | MFU | peak mem (GiB) | packed speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {fmt(r.get('run'), 'd')} | {SHAPES[r['shape']]} | {'LoRA' if r['training'] == 'lora' else 'full (ZeRO-3, CPU optimizer)'} | "
                f"{r['packing']}{' + compile' if r.get('compile') else ''} |")
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | | | | |")
            continue
        other = next((o for o in rows if o["shape"] == r["shape"] and o["training"] == r["training"] and same_run(o, r)
                      and o["packing"] == "off" and not o.get("compile") and "error" not in o), None)
        speedup = f"{other['step_s'] / r['step_s']:.2f}x" if r["packing"] == "on" and other else ""
        lines.append(f"{head} {r['sequences']:.0f} | {r['real_tokens']:,.0f} | {r['padded_tokens']:,.0f} | {r['step_s']:.3f} | "
                     f"{fmt(r['fwd_bwd_s'], '.3f')} | {fmt(r['optimizer_s'], '.3f')} | {r['tokens_per_s']:,.0f} | "
                     f"{fmt(r['mfu'], '.1%') or 'n/a (CPU)'} | {fmt(r['peak_gib'], '.1f') or 'n/a (CPU)'} | {speedup} |")
    return lines


def rl_table(rows: list[dict]) -> list[str]:
    lines = ["| run | model | recipe | step | rollout s | reward s | old+ref scoring s | fwd+bwd s | optimizer s | other s | "
             "step s | groups with zero reward spread | peak mem (GiB) | speed-up vs public |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {fmt(r.get('run'), 'd')} | {SHAPES[r['shape']]} | {'DARE' if r['recipe'] == 'dare' else 'public d1 recipe'} |"
        if "error" in r:
            lines.append(f"{head} | {r['error']} | | | | | | | | | |")
            continue
        public = next((o for o in rows if o["shape"] == r["shape"] and o["recipe"] == "public" and same_run(o, r)
                       and "error" not in o), None)
        speedup = f"{public['step_s'] / r['step_s']:.2f}x" if r["recipe"] == "dare" and public else ""
        phases = " | ".join(f"{r[p]:.2f}" for p in RL_PHASES)
        lines.append(f"{head} {r['step']} | {phases} | {r['other']:.2f} | {r['step_s']:.2f} | {fmt(r['zero_std_ratio'], '.0%')} | "
                     f"{fmt(r['peak_gib'], '.1f') or 'n/a (CPU)'} | {speedup} |")
    return lines


def export_parts(row: dict) -> dict:
    # rows of commit 92d9a75 recorded the disk wait alone
    return row.get("export_parts") or {"disk_wait": row.get("export_disk_wait_s")}


def startup_table(rows: list[dict]) -> list[str]:
    lines = ["| run | model | stage | process start to stage s | start-up s (target <= 30) | checks s | load s | engine s | "
             "export of the merged model s (target <= 30) | export: merge s | export: copy off the GPU s | export: waiting for the disk s | export: open/close s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "folder" or "error" in r or r.get("startup_s") is None:
            continue
        run = (f"SFT {r['training']} packing {r['packing']}{' + compile' if r.get('compile') else ''}"
               if r["part"].startswith("sft") else f"RL ({r['recipe']})")
        parts = " | ".join(fmt(r["startup_parts"].get(p), ".1f") for p in STARTUP_PHASES)
        lines.append(f"| {fmt(r.get('run'), 'd')} | {SHAPES[r['shape']]} | {run} | {fmt(r.get('launch_s'), '.1f')} | {r['startup_s']:.1f} | {parts} | "
                     f"{fmt(r.get('export_s'), '.1f')} | " + " | ".join(fmt(export_parts(r).get(p), ".1f") for p in EXPORT_PHASES) + " |")
    return lines


def acceptance(rows: list[dict], runs: Optional[list[dict]] = None) -> list[str]:
    """The issue's targets, computed from each run's own rows (a merged file holds several runs)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get("run"), []).append(r)
    if len(groups) <= 1:
        return run_acceptance(rows)
    out = []
    for run, group in sorted(groups.items(), key=lambda item: -1 if item[0] is None else item[0]):
        lines = run_acceptance(group)
        if lines != ["- nothing to compare in this run"]:
            commit = runs[run]["commit"][:7] if runs and run is not None and run < len(runs) else "?"
            out.append(f"- run {run} (commit {commit}):")
            out += ["  " + line for line in lines]
    return out or ["- nothing to compare in this run"]


def run_acceptance(rows: list[dict]) -> list[str]:
    """The targets from the rows of one run (LLaDA-8B shape)."""
    def find(**keys):
        return next((r for r in rows if all(r.get(k) == v for k, v in keys.items()) and "error" not in r), None)

    out = []
    # packed eager, and packed compiled where that was run, each against the padded eager run
    padded = find(shape="llada", part="sft", packing="off", compile=False)
    for compiled in (False, True):
        packed = find(shape="llada", part="sft", packing="on", compile=compiled)
        how = " + compile" if compiled else ""
        if packed and packed.get("mfu") is not None:
            out.append(f"- packed{how} LoRA SFT at LLaDA-8B: MFU {packed['mfu']:.1%} (target >= 40 %): "
                       f"{'met' if packed['mfu'] >= 0.40 else 'not met'}")
        if packed and padded and same_run(packed, padded):
            ratio = padded["step_s"] / packed["step_s"]
            out.append(f"- packed{how} vs padded LoRA SFT at LLaDA-8B: {ratio:.2f}x (target >= 1.7x): "
                       f"{'met' if ratio >= 1.7 else 'not met'}")
    ours, public = find(shape="llada", part="rl"), find(shape="llada", part="rl-public")
    if ours and public and not same_run(ours, public):
        out.append(f"- RL step at LLaDA-8B vs the public recipe: not compared (DARE {ours['step_s']:.1f} s and public "
                   f"{public['step_s']:.1f} s come from different runs)")
    elif ours and public:
        ratio = public["step_s"] / ours["step_s"]
        out.append(f"- RL step at LLaDA-8B vs the public recipe: {ratio:.2f}x (target >= 6x): {'met' if ratio >= 6 else 'not met'}")
    for r in rows:
        for key, what in (("startup_s", "start-up"), ("export_s", "export")):
            if r.get(key) is not None and r[key] > 30:
                out.append(f"- {what} of {SHAPES[r['shape']]} ({r['part']}, {r.get('packing') or r.get('recipe')}): "
                           f"{r[key]:.1f} s (target <= 30 s): not met")
    return out or ["- nothing to compare in this run"]


def setup_lines(s: Settings, args, runs: list[dict]) -> list[str]:
    folder_rows = [r for r in runs if r.get("part") == "folder" and "error" not in r]
    made = "; ".join(f"{SHAPES[r['shape']]}: {r['params'] / 1e9:.3g} B parameters in {r['files']} shards, drawn in "
                     f"{r['init_s']:.1f} s, saved in {r['save_s']:.1f} s" for r in folder_rows)
    return [
        "- Model folders: the real config.json of bench/configs, random bf16 weights drawn on the device, written by "
        "`save_model` with the reference index's parameter names (checked), loaded by each stage through `model.path`"
        + (f" ({made})" if made else "") + ("; page cache dropped before every run (cold reads)" if args.cold else "") + ".",
        f"- SFT: {s.sft_micro} sequences per micro-batch x {s.sft_accum} accumulated = {s.sft_micro * s.sft_accum} per step, "
        f"real lengths uniform in [{s.sft_min_len}, {s.sft_max_len}] (LLaDA: prompt + the {s.sft_pad_to}-token canvas; SDAR: "
        f"prompt + response + EOS), {s.sft_warmup} warm-up step then {s.sft_steps} timed; LoRA r {s.sft_lora[0]}, alpha "
        f"{s.sft_lora[1]}, gradient checkpointing. tokens/s counts real tokens; MFU = model FLOPs (bench/model_throughput.py: "
        f"6 x non-embedding parameters per real token + attention; SDAR's two-stream layout counts each token twice) / time / "
        f"peak bf16. With LoRA the backward skips the frozen weights' gradients (-2N) while checkpointing recomputes the "
        f"forward (+2N), so 6N is also about what the GPU executes. Packed: `model.packing: on`; padded: `off`; + compile: `model.compile: true` as well (the first step compiles; from commit 852f02c Inductor rounds to bf16 where eager does, before it the loss drifted ~3 % from eager's).",
        f"- RL: d1, {s.rl_prompts} prompts x {s.rl_group} rollouts (prompts {s.rl_prompt_min}-{s.rl_prompt_max} tokens), gen "
        f"{s.rl_gen}, {s.rl_denoise_steps} denoising steps, block {s.rl_block} (SDAR: its block of 4), temperature "
        f"{s.rl_temperature}, {s.rl_iterations} inner iterations, micro-batches of {s.rl_micro}, KL {s.rl_kl} (reference = "
        f"adapter disabled), LoRA r {s.rl_lora[0]}, alpha {s.rl_lora[1]}, gradient checkpointing; reward: a hash of the "
        f"response tokens' text. DARE: dual cache (SDAR: block_kv), CUDA graphs on the GPU of forwards whose layers run through one torch.compile'd layer call (`compile_forward`; from commit 92d9a75, before it the whole forward was compiled per window shape), {s.rollout_batch} rollouts per batch, "
        f"packed training, step {s.rl_steps} shown. Public recipe: no cache, float64 Gumbel-max and softmax, eager, "
        f"{s.public_chunk} rollouts per generate call, padded training with logits over the whole canvas, step "
        f"{s.rl_public_steps} shown. Phase times come from the loops' metrics (`DARE_PHASE_TIMES`, GPU synchronised at "
        f"every phase boundary); 'other' is the rest of the step.",
    ]


def report(data: dict, s: Settings, args) -> str:
    rows = data["rows"]
    runs = data["runs"]
    tiny = " (--tiny: a shrunken model; the numbers check the script and measure nothing)" if args.tiny else ""
    lines = [f"# Training step on one GPU: the stage loops at the LLaDA-8B and SDAR-8B shapes{tiny}", ""]
    commits = list(dict.fromkeys(run["commit"] for run in runs))
    lines.append(f"Git commit: {', '.join(commits)}  ")
    for i, run in enumerate(runs):
        what = f"; rows: {', '.join(run['rows'])}" if run.get("rows") else ("; its rows were measured again later" if "rows" in run else "")
        lines.append(f"Command{f' (run {i})' if len(runs) > 1 else ''}: `{run['command']}` ({run['date']}, commit {run['commit']}{what})  ")
    lines.append(f"Hardware: {runs[-1]['hardware']}  ")
    lines.append(f"Libraries: {runs[-1].get('libraries', '(not recorded by these runs)')}")
    lines += [""] + setup_lines(s, args, rows) + [""]
    sft = [r for r in rows if r["part"] in ("sft", "sft-full")]
    rl = [r for r in rows if r["part"] in ("rl", "rl-public")]
    folders = [r for r in rows if r["part"] == "folder" and "error" in r]
    for r in folders:
        lines.append(f"- {SHAPES[r['shape']]}: the model folder could not be written: {r['error']}")
    if sft:
        lines += ["## SFT: tokens/s, MFU and peak memory, packed vs padded", ""] + sft_table(sft) + [""]
    if rl:
        lines += ["## RL: one d1 step, DARE vs the public d1 recipe (seconds)", ""] + rl_table(rl) + [""]
    if sft or rl:
        lines += ["## Start-up and export", ""] + startup_table(sft + rl) + [""]
    lines += ["## Targets", ""] + acceptance(rows, runs) + [""]
    return "\n".join(lines)


def row_key(row: dict) -> tuple:
    """What a row measures: a later run of the same replaces it (--add)."""
    return row["part"], row["shape"], row.get("training"), row.get("packing"), row.get("compile"), row.get("recipe")


def merge_previous(path: Path, run: dict, keep: bool) -> dict:
    """The rows of earlier runs to keep (--add): same commit, machine and settings only."""
    if not keep or not path.exists():
        return {"runs": [], "rows": []}
    old = json.loads(path.read_text())
    last = old["runs"][-1] if old.get("runs") else {}
    if any(last.get(k) != run[k] for k in ("commit", "hardware", "settings")):
        print(f"[train_step] {path}: earlier rows are from another commit, machine or settings; not kept", flush=True)
        return {"runs": [], "rows": []}
    return old


def run_label(row: dict) -> str:
    return f"{row['part']} {SHAPES[row['shape']]}" + (f" {row['packing']}" if row.get("packing") else "") + \
        (" + compile" if row.get("compile") else "")


def merge_files(paths: list[Path], out: Path, args) -> int:  # noqa: C901
    """One results file from several runs' JSON (runs of one machine and settings, split to fit a time
    limit, possibly at different commits): each run is listed with the rows it measured."""
    merged: dict = {"runs": [], "rows": []}
    for path in paths:
        data = json.loads(path.read_text())
        first = merged["runs"][0] if merged["runs"] else None
        for run in data["runs"]:
            known = not run["hardware"].startswith("(no run finished)")  # older files: an RL-only run named none
            if first and (first["settings"] != run["settings"] or (known and first["hardware"] != run["hardware"])):
                raise SystemExit(f"{path}: measured on other hardware or with other settings than {paths[0]}")
        offset = len(merged["runs"])
        merged["runs"] += [dict(r) for r in data["runs"]]
        # a file written by an earlier merge credits each row to one of its runs already
        rows = [{**r, "run": offset + r.get("run", len(data["runs"]) - 1)} for r in data["rows"]]
        if not args.keep_all:
            keys = {row_key(r) for r in rows}
            merged["rows"] = [r for r in merged["rows"] if row_key(r) not in keys]
        merged["rows"] += rows
    for i, run in enumerate(merged["runs"]):  # the rows of each run that the file shows
        run["rows"] = [run_label(r) for r in merged["rows"] if r.get("run") == i and r["part"] != "folder"]
    s = Settings(**merged["runs"][-1]["settings"])
    command = "python3 bench/train_step.py " + ("--keep-all " if args.keep_all else "") + "--merge " + " ".join(shlex.quote(str(p)) for p in paths)
    text = report(merged, s, args).replace("Hardware:", f"Written from those runs' JSON files by `{command}`  \nHardware:", 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(merged, indent=1))
    print(text)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", type=Path, help=argparse.SUPPRESS)  # a child: run one task
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--public-shapes", nargs="+", choices=list(SHAPES), default=["llada"],
                   help="shapes that also run the public d1 recipe (d1 is LLaDA's; default: llada)")
    p.add_argument("--compile-shapes", nargs="*", choices=list(SHAPES), default=["llada"],
                   help="shapes whose LoRA SFT also runs packed with model.compile on (default: llada)")
    p.add_argument("--full-param", choices=("auto", "run"), default="auto",
                   help="auto: skip, saying why, where the host cannot hold the CPU optimizer state")
    p.add_argument("--workdir", default="/tmp/dare-bench", help="model folders, data and runs (kept between runs)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "train_step.md"))
    p.add_argument("--add", action="store_true", help="keep the rows of earlier runs of this commit (their JSON beside --out)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="drop the model folder from the page cache before each run (default: on)")
    p.add_argument("--task-timeout", type=float, default=0, help="seconds one run may take (0: no limit)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the same code paths, two tiny layers")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                   help="change a batch shape or step count (the fields of Settings), e.g. rollout_batch=128")
    p.add_argument("--verbose", action="store_true", help="show the runs' output instead of logging it")
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                   help="run nothing: write --out from the rows of these results files (earlier ones first, a later "
                        "row replaces an earlier one of the same measurement), each row credited to its run")
    p.add_argument("--keep-all", action="store_true", help="with --merge: keep every run's rows (each run's ratios and targets "
                   "stay computable) instead of a later row replacing an earlier one of the same measurement")
    args = p.parse_args(argv)
    if args.task is not None:
        return task_main(args.task)
    if args.merge:
        return merge_files(args.merge, Path(args.out), args)
    try:
        s = (Settings.tiny() if args.tiny else Settings()).with_overrides(args.set)
    except ValueError as exc:
        p.error(str(exc))
    workdir = Path(args.workdir)
    # (is_available starts no CUDA context: this process leaves the GPU's memory to the runs)
    if not torch.cuda.is_available() and not args.tiny:
        p.error("no GPU here: use --tiny for the CPU smoke run")
    runner = Runner(workdir, args.task_timeout, args.verbose)
    out = Path(args.out)
    commit = git_commit()
    command = "python3 bench/train_step.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    previous = None

    def save(rows: list[dict]) -> str:
        nonlocal previous
        hw = next((r["hardware"] for r in rows if r.get("hardware")), None) or f"(no run finished) {platform.machine()}"
        run = {"commit": commit, "command": command, "hardware": hw, "settings": dataclasses.asdict(s), "date": date,
           "libraries": library_versions()}
        if previous is None:  # read once: later saves rewrite the file this run is writing
            previous = merge_previous(out.with_suffix(".json"), run, args.add)
        done = {row_key(r) for r in rows}
        data = {"runs": previous["runs"] + [run], "rows": [r for r in previous["rows"] if row_key(r) not in done] + rows}
        text = report(data, s, args)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, text)
        write_atomic(out.with_suffix(".json"), json.dumps(data, indent=1))
        return text

    rows = Rows(save)
    for shape in args.shapes:
        run_shape(shape, args.parts, args, s, runner, rows)
    print(save(list(rows)))
    return 0


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
