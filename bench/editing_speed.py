"""Token editing's cost at LLaDA2.1-mini's shape: tokens/s of LLaDA2.1's speed and quality modes and
of decoding without edits, at batch 1, 32 and 128, random bf16 weights, one GPU.

    python3 bench/editing_speed.py --out bench/results/editing_speed.md        # GPU
    python3 bench/editing_speed.py --smoke --out tmp/editing_speed.md           # the CPU check of the script

The model is built from LLaDA2.1-mini's released config.json (`bench/configs/LLaDA2.1-mini.json`:
20 layers of width 2048, 256 experts of which 8 route a token beside a shared one) with random
weights; prompts of `--prompt` random tokens; `--gen` response tokens in blocks of 32 with the block
KV cache, greedy, no stop (every row decodes all its blocks). Modes (docs/sampling.md#token-editing):
speed and quality as `EDITING_MODES` has them (16 post-edit steps), and "none": quality's commit
threshold without editing.

Random weights give near-uniform distributions: no confidence reaches a commit threshold, so every
step commits one token (the rule's floor), and what the edit threshold lets through decides the
post-edit steps (speed's 0.0 edits wherever the argmax moved; quality's 0.5 never passes, so a block
costs one forward more). The table therefore shows the forward cost of each step at this shape and
the steps these settings take on an untrained model; a trained model commits several tokens a step
(bench/results/editing_modes.md measures steps per token on one).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dare_core.models.lm import build_model  # noqa: E402
from dare_core.sampling.decode import generate  # noqa: E402
from dare_core.sampling.params import EDITING_MODES, SamplingParams  # noqa: E402
from stamp import git_commit, hardware, header, markdown_table, utc_now, write_atomic  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "LLaDA2.1-mini.json"
BLOCK = 32
MODES = {"none": {**EDITING_MODES["quality"], "edit_threshold": None}, **EDITING_MODES}
# --smoke: two narrow layers, 8 experts, a small vocabulary holding the special ids
SMOKE = {"num_hidden_layers": 2, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
         "topk_group": 1, "vocab_size": 512, "mask_token_id": 500, "eos_token_id": 501, "pad_token_id": 502}


def random_model(device: str, smoke: bool):
    cfg = json.loads(CONFIG.read_text())
    cfg.update(SMOKE if smoke else {})
    model = build_model(cfg, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(0)
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    return model.eval(), cfg


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(model, prompts: list, params: SamplingParams) -> dict:
    """One timed decode after a warm-up of its first block (CUDA graphs captured, kernels chosen)."""
    generate(model, prompts, params, max_blocks=1)
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = generate(model, prompts, params)
    sync()
    seconds = time.perf_counter() - t
    steps = out.steps.float()
    tokens = len(prompts) * params.gen_length
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "steps_max": int(steps.max()),
            "steps_per_token": float(steps.sum()) / tokens, "ms_per_step": seconds / float(steps.max()) * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 32, 128])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--smoke", action="store_true", help="two narrow layers on the CPU: checks the script, measures nothing")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    commit, started = git_commit(), utc_now()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model, cfg = random_model(device, args.smoke)
    rows, cells = [], []
    for batch in args.batch:
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(10, 500, (batch, args.prompt), generator=g).tolist()
        for mode in args.modes:
            params = SamplingParams(gen_length=args.gen, steps=args.gen, block_length=BLOCK, cache="block_kv",
                                    stop_at_eos=False, **MODES[mode])
            try:
                r = run(model, prompts, params)
            except torch.cuda.OutOfMemoryError:
                r = {"error": "out of memory"}
                torch.cuda.empty_cache()
            rows.append({"batch": batch, "mode": mode, **r})
            print(rows[-1], flush=True)
            cells.append([batch, mode, MODES[mode]["threshold"], "none" if MODES[mode]["edit_threshold"] is None else MODES[mode]["edit_threshold"],
                          *([r["error"], "", "", "", ""] if "error" in r else
                            [f"{r['tokens_per_s']:.1f}", f"{r['ms_per_step']:.1f}", f"{r['steps_per_token']:.3f}",
                             f"{r['seconds']:.2f}", "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"])])
    command = "python3 bench/editing_speed.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    shape = (f"{cfg['num_hidden_layers']} layers of width {cfg['hidden_size']}, {cfg['num_experts']} experts "
             f"({cfg['num_experts_per_tok']} a token and {cfg.get('num_shared_experts', 0)} shared), vocabulary {cfg['vocab_size']}")
    text = "\n".join([
        *header("Token editing's cost at LLaDA2.1-mini's shape (random weights)", command, hardware(), commit, date=started),
        f"Model: LLaDA2.1-mini's config ({shape}{'; --smoke: shrunk' if args.smoke else ''}), random weights, "
        f"{'bf16' if device == 'cuda' else 'float32'} on {device}. Prompt {args.prompt} random tokens, {args.gen} response "
        f"tokens in blocks of {BLOCK}, block KV cache, greedy, no stop. Tokens/s: the batch's response tokens over the "
        f"timed decode (after a one-block warm-up); ms a step: that time over the longest row's steps; steps a token: "
        f"every row's steps over its tokens. Random weights commit one token a step (see the script's docstring).", "",
        *markdown_table(["batch", "mode", "commit threshold", "edit threshold", "tokens/s", "ms a step", "steps a token",
                         "seconds", "peak GiB"], cells), ""])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text)
    write_atomic(out.with_suffix(".json"), json.dumps({"commit": commit, "command": command, "rows": rows}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
