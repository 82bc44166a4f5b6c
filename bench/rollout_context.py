"""Long-response rollouts: ms per denoising step as the context grows, and the memory the decoding
holds beside the weights, at the real 8B shapes (random bf16 weights, greedy, CUDA graphs).

    python3 bench/rollout_context.py --out bench/results/rollout_context.md      # GPU
    python3 bench/rollout_context.py --smoke --out /tmp/rollout_context.md      # 2 small layers on CPU

- SDAR-8B-Chat, block KV cache: a block of 4 attends to the cached keys and values of everything
  before it, so a step's cost grows with the tokens before the block. The context is a prompt of C
  tokens (the KV cache a block of a C-token response's end would read); blocks of 4, 4 steps each.
- LLaDA-8B-Instruct, dual cache: every block's first step re-encodes the whole canvas (a 128-token
  prompt and a G-token response), the block's other steps attend to that cache; a step's cost follows
  the canvas, not the block's place in it. Blocks of 32, one token per step (d1's schedule).

One step is timed as (decoding `1 + k` blocks less decoding 1 block) / (k x steps per block): the
first block carries the once-per-call work (the canvas, the prompt's prefill, the outputs), so what
remains is the steady step at that context, its share of the block refreshes included. Memory: the
peak above the weights while decoding `1 + k` blocks (the previous shape's graphs freed first): the
KV cache, the canvas, the captured graphs' pools and the activations of the largest forward.
LLaDA-8B's config allows 4,096 positions: its contexts stop at 3,968 response tokens.
"""
from __future__ import annotations

import argparse
import gc
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import SMOKE_SHRINK, random_model, sync  # noqa: E402
from stamp import hardware, header, markdown_table, write_atomic  # noqa: E402
from dare_core.sampling.decode import generate  # noqa: E402
from dare_core.sampling.graphs import release_graph_store  # noqa: E402
from dare_core.sampling.params import SamplingParams  # noqa: E402

PROMPT_LLADA = 128


def timed_generate(model, prompts, params: SamplingParams, blocks: int) -> tuple[float, float]:
    """(seconds of one call decoding `blocks` blocks after a warm-up call, the peak bytes of the two
    above the weights: the previous shape's graphs and cache are freed first)."""
    cuda = torch.cuda.is_available()
    if cuda:
        release_graph_store(model)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    generate(model, prompts, params, max_blocks=blocks)  # warm-up: CUDA-graph capture
    sync()
    t = time.perf_counter()
    generate(model, prompts, params, max_blocks=blocks)
    sync()
    seconds = time.perf_counter() - t
    return seconds, (torch.cuda.max_memory_allocated() - before) if cuda else 0


def measure(model, name: str, context: int, batch: int, blocks: int, device: str) -> dict:
    is_block = model.block_size is not None
    g = torch.Generator().manual_seed(1)
    if is_block:  # the context is the prompt; the response only needs room for the timed blocks
        block, steps_per_block = model.block_size, model.block_size
        prompt, gen = context, model.block_size * (blocks + 1)
    else:
        block, steps_per_block = 32, 32
        prompt, gen = PROMPT_LLADA, context
    prompts = torch.randint(10, 1000, (batch, prompt), generator=g).tolist()
    params = SamplingParams(gen_length=gen, block_length=block, steps=gen // block * steps_per_block, stop_at_eos=False,
                            cache="block_kv" if is_block else "dual", cuda_graphs=device == "cuda")
    row = {"model": name, "cache": params.cache, "context": context, "batch": batch, "prompt": prompt, "gen": gen}
    try:
        one, _ = timed_generate(model, prompts, params, 1)
        more, peak = timed_generate(model, prompts, params, 1 + blocks)
    except torch.cuda.OutOfMemoryError:
        release_graph_store(model)
        return {**row, "error": "out of memory"}
    step = (more - one) / (blocks * steps_per_block)
    return {**row, "ms_per_step": step * 1e3, "tokens_per_s": batch * block / (step * steps_per_block),
            "peak_gib": peak / 2**30}


def run(args, after_row) -> list[dict]:
    """Every (model, context, batch) row; `after_row(rows)` after each (the file is rewritten, so a
    run cut short keeps the rows it finished)."""
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    rows = []
    for name in args.configs:
        model = random_model(name, device, SMOKE_SHRINK if args.smoke else None)
        is_block = model.block_size is not None
        blocks = args.sdar_blocks if is_block else args.llada_blocks
        for context in args.contexts if is_block else args.llada_contexts:
            for batch in args.batch:
                rows.append(measure(model, name, context, batch, blocks, device))
                print(rows[-1], flush=True)
                after_row(rows)
                if device == "cuda":
                    torch.cuda.empty_cache()
        release_graph_store(model)
        del model  # before the next config's weights are drawn
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], args) -> list[str]:
    lines = [f"SDAR: context = a prompt of that many tokens, blocks of 4 with 4 steps each, {args.sdar_blocks} blocks timed "
             f"after the first. LLaDA: context = a {PROMPT_LLADA}-token prompt + a response canvas of that many tokens, "
             f"blocks of 32 with one token per step, {args.llada_blocks} block(s) timed after the first (each block's first "
             "step re-encodes the whole canvas). Greedy, CUDA graphs; memory is the peak above the weights.", ""]
    cells = []
    for r in rows:
        what = [r["model"], r["cache"], f"{r['context']:,}", r["batch"]]
        if "error" in r:
            cells.append(what + [r["error"], "", ""])
        else:
            cells.append(what + [f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['peak_gib']:.1f}"])
    return lines + markdown_table(["model", "cache", "context tokens", "batch", "ms / step", "tokens/s", "memory beside the weights (GiB)"],
                                  cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["SDAR-8B-Chat", "LLaDA-8B-Instruct"])
    p.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096, 8192, 16384], help="SDAR's")
    p.add_argument("--llada-contexts", nargs="+", type=int, default=[1024, 2048, 3968])
    p.add_argument("--batch", nargs="+", type=int, default=[8, 32])
    p.add_argument("--sdar-blocks", type=int, default=8, help="SDAR blocks timed after the first")
    p.add_argument("--llada-blocks", type=int, default=1, help="LLaDA blocks timed after the first")
    p.add_argument("--smoke", action="store_true", help="2 small layers on CPU: checks the script, measures nothing")
    p.add_argument("--out", default="bench/results/rollout_context.md")
    args = p.parse_args()
    top = header("Rollout step time and memory vs context length, random bf16 weights at the real 8B configs",
                 "python3 bench/rollout_context.py " + shlex.join(sys.argv[1:]), hardware())

    def write(rows: list[dict]) -> None:
        write_atomic(Path(args.out), "\n".join(top + table(rows, args)) + "\n")

    rows = run(args, write)
    write(rows)
    print("\n".join(top + table(rows, args)))


if __name__ == "__main__":
    main()
