"""bench/train_step.py's inputs: the batch shapes and step counts of its runs (`Settings`), the model
folder of each shape (the real config, random weights, the real parameter names and shard size) and
the prepared data every run reads. bench/multi_gpu.py builds its runs from the same pieces."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stamp import REPO, hardware

CONFIGS = REPO / "bench" / "configs"
SHAPES = {"llada": "LLaDA-8B-Instruct", "sdar": "SDAR-8B-Chat"}
FAMILIES = {"llada": "llada", "sdar": "sdar"}
PARTS = ("sft", "sft-full", "rl", "rl-d1", "rl-engines")

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
    rl_logits_chunk: int = 0  # DARE's model.logits_chunk in the RL runs (0: whole logits)
    rl_lora_merged: bool = True  # DARE's GPU rollouts with the adapter folded into the weights (rl.sampler.lora_merged)
    rl_steps: int = 2  # DARE's step is timed at the last one (the first captures graphs, compiles)
    rl_public_steps: int = 1  # d1's own code: steps (nothing to warm up: no graphs, nothing compiled)
    # DARE: rollouts per sampler batch: all 128 at once (one KV cache: about 30 GB at LLaDA-8B)
    rollout_batch: int = 128
    public_chunk: int = 6  # d1's own code: rollouts a generate call and a per-device batch (its generation_batch_size)

    def with_overrides(self, items: list[str]) -> "Settings":
        """`name=value` pairs (`--set rollout_batch=128 sft_lora=16,8`), typed like the defaults."""
        changes = {}
        for item in items:
            name, sep, value = item.partition("=")
            current = getattr(self, name, None)
            if not sep or current is None:
                names = [f.name for f in dataclasses.fields(self)]
                raise ValueError(f"--set {item}: expected name=value with a name of {names}")
            if isinstance(current, bool):  # (bool("false") is True)
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"--set {item}: {name} is true or false")
                changes[name] = value.lower() in ("true", "1")
                continue
            changes[name] = tuple(int(v) for v in value.split(",")) if isinstance(current, tuple) else type(current)(value)
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls) -> "Settings":
        return cls(sft_min_len=16, sft_max_len=48, sft_pad_to=8, sft_micro=4, sft_accum=2, sft_steps=1, sft_lora=(4, 8),
                   rl_prompts=4, rl_group=4, rl_gen=16, rl_block=8, rl_denoise_steps=8, rl_prompt_min=8, rl_prompt_max=16,
                   rl_micro=8, rl_lora=(4, 8), rollout_batch=16, public_chunk=6)


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


def write_model_folder(shape: str, folder: Path, tiny: bool, std: float = 0.02) -> dict:
    """The shape's checkpoint folder: random bf16 weights (normal, `std`) drawn on the device, saved
    by `save_model` with the tokenizer; checks that its parameter names are the reference index's."""
    from dare_core.models.lm import empty_model
    from dare_core.models.hf_folder import save_model

    hf_config = shape_config(shape, tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = empty_model(hf_config, device=device, dtype=torch.bfloat16)
    model.net.init_weights(torch.Generator(device).manual_seed(0), std=std)
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


# --------------------------------------------------------------------------- full-parameter training


def optimizer_host_bytes(n_params: int) -> int:
    """Host memory of ZeRO-3's CPU optimizer: fp32 weights, gradients and two Adam moments."""
    return 16 * n_params

