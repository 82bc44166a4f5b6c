"""Forward and forward+backward throughput of real 8B configs (random bf16 weights), padded vs packed.

    python3 bench/model_throughput.py --configs LLaDA-8B-Instruct SDAR-8B-Chat --out bench/results/model_throughput.md

Sequence lengths are drawn uniformly in [min_len, max_len] (a realistic SFT/RL length spread).
Padded: one [B, max_len] batch with a key-padding mask (SDPA). Packed: the same tokens back to back
with per-sequence positions, through the varlen kernel (bidirectional families) or FlexAttention
(block diffusion). MFU = model FLOPs / (time x peak bf16 dense FLOP/s); model FLOPs count the
matmuls (2 x params per token forward, x3 with backward) plus attention scores over each
sequence's own length (useful work only: padding is not counted).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dare_core.models.lm import build_model  # noqa: E402
from stamp import git_commit, hardware, library_versions, markdown_table, utc_now  # noqa: E402

# the real config.json files of the checkpoints (copied from their public releases)
CONFIGS = Path(__file__).resolve().parent / "configs"
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


def peak_bf16() -> Optional[float]:
    """Peak dense bf16 FLOP/s of this GPU (one not in PEAK_BF16 is taken as an H100); None on the CPU."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), PEAK_BF16["H100"])


def model_flops(model, lens: list[int], backward: bool) -> float:
    c = model.config
    n_params = sum(p.numel() for n, p in model.net.named_parameters() if "embed" not in n)
    matmul = 2 * n_params * sum(lens)
    attn = sum(4 * c.n_layers * c.n_heads * c.head_dim * n * n for n in lens)  # QK^T and AV, bidirectional
    if model.block_size:
        attn = attn / 2  # block-causal: about half the pairs
    return (matmul + attn) * (3 if backward else 1)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters


def run(name: str, batch: int, min_len: int, max_len: int, seed: int, device: str = "cuda", shrink: dict | None = None,
        micro: int = 0) -> list[dict]:
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg.update(shrink or {})
    cfg.setdefault("mask_token_id", 1)
    torch.set_default_dtype(torch.bfloat16)
    model = build_model(cfg, device=device)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (batch,), generator=g).tolist()
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in lens]
    # the padded baseline: every sequence padded to the batch's longest (LLaDA's recipe), run in
    # micro-batches of `micro` sequences (all at once if 0) with gradients accumulated, as a padded
    # trainer does to fit memory
    micro = micro or batch
    width = max(lens)
    chunks = []
    for lo in range(0, batch, micro):
        part = seqs[lo:lo + micro]
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for i, t in enumerate(part):
            ids[i, : len(t)] = t
            mask[i, : len(t)] = 1
        chunks.append((ids.to(device), mask.to(device)))
    padded_tokens = sum(ids.numel() for ids, _ in chunks)
    packed = torch.cat(seqs).to(device)
    packed_backend = "sdpa" if device == "cpu" else "flex" if model.block_size else "varlen"
    rows = []
    peak = peak_bf16() or PEAK_BF16["H100"]

    def pad_fwd():
        with torch.no_grad():
            for ids, mask in chunks:
                model(ids, mask)

    def pack_fwd():
        with torch.no_grad():
            model.forward_packed(packed, lens, backend=packed_backend)

    def pad_fwd_bwd():
        for ids, mask in chunks:
            model(ids, mask).float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    def pack_fwd_bwd():
        model.forward_packed(packed, lens, backend=packed_backend).float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    for label, fn, backward in (("padded fwd", pad_fwd, False), (f"packed fwd ({packed_backend})", pack_fwd, False),
                                ("padded fwd+bwd", pad_fwd_bwd, True), (f"packed fwd+bwd ({packed_backend})", pack_fwd_bwd, True)):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            sec = timed(fn)
        except torch.cuda.OutOfMemoryError:
            rows.append({"model": name, "mode": label, "error": "out of memory"})
            continue
        except Exception as exc:  # e.g. no varlen kernel in this torch build: say so in the table
            rows.append({"model": name, "mode": label, "error": f"{type(exc).__name__}: {str(exc)[:100]}"})
            continue
        tokens = sum(lens)
        rows.append({"model": name, "mode": label, "tokens": tokens, "padded_tokens": padded_tokens, "ms": sec * 1e3,
                     "tokens_per_s": tokens / sec, "mfu": model_flops(model, lens, backward) / sec / peak,
                     "max_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["LLaDA-8B-Instruct", "SDAR-8B-Chat"])
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/model_throughput.md")
    p.add_argument("--micro", type=int, default=0, help="padded baseline micro-batch size (0: the whole batch at once)")
    p.add_argument("--smoke", action="store_true", help="2 layers, width 256, on CPU: checks the script, measures nothing")
    args = p.parse_args()
    shrink, device = None, "cuda"
    if args.smoke:
        shrink, device = {"n_layers": 2, "num_hidden_layers": 2, "d_model": 256, "hidden_size": 256, "mlp_hidden_size": 512,
                          "intermediate_size": 512, "n_heads": 4, "n_kv_heads": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "head_dim": 64, "vocab_size": 1024, "embedding_size": 1024}, "cpu"
    rows = []
    for name in args.configs:
        rows += run(name, args.batch, args.min_len, args.max_len, args.seed, device, shrink, args.micro)
        for r in rows:
            print(r, flush=True)
    lines = [
        "# Model throughput: padded vs packed, real 8B configs, random bf16 weights",
        "",
        f"Git commit: {git_commit()}  ", f"Libraries: {library_versions()}  ",
        f"Date: {utc_now()}  ",
        f"Command: `python3 bench/model_throughput.py --batch {args.batch} --min-len {args.min_len} --max-len {args.max_len} --micro {args.micro}`  ",
        f"Hardware: {hardware()} (peak bf16 dense taken as 989 TFLOP/s)  ",
        f"Batch: {args.batch} sequences, lengths uniform in [{args.min_len}, {args.max_len}] (seed {args.seed}); padded baseline in "
        f"micro-batches of {args.micro or args.batch}, every sequence padded to the batch's longest, gradients accumulated.",
        "",
    ]
    columns = ["model", "mode", "real tokens", "padded tokens", "ms / step", "tokens/s", "MFU", "peak mem (GiB)"]
    lines += markdown_table(columns, [
        [r["model"], r["mode"], "", "", r["error"], "", "", ""] if "error" in r else
        [r["model"], r["mode"], r["tokens"], r["padded_tokens"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}",
         f"{r['max_mem_gb']:.1f}"] for r in rows])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
