"""Rollout speed: ms per denoising step and tokens/s of every cache mode, side by side in one run.

    python3 bench/rollout.py speed --out bench/results/rollout_speed.md          # GPU, random 8B weights
    python3 bench/rollout.py threshold --model runs/embedded/sft/model \\
        --data data/prepared/eval.parquet --out bench/results/rollout_threshold.md   # a trained model

speed: random bf16 weights at the real LLaDA-8B-Instruct and SDAR-8B-Chat configs, prompt 128,
gen length 256 and 1024, batch 1 and 32, greedy. Modes:
  reference   what the public LLaDA sampler computes per step: the whole canvas re-encoded, logits for
              every position, a float64 softmax over the full vocabulary (batch 1 only: at batch 32
              the float64 probabilities alone would take tens of GB)
  none        our loop without a cache (logits only for the current block)
  prefix/dual Fast-dLLM caches, refreshed once per block; `+graph` replays the one-block forward as a
              CUDA graph, `eager` does not; `+compile` runs torch.compile on it before the capture
  block_kv    block diffusion KV cache (SDAR)
Steps are timed over the first blocks only (`--steps` denoising steps per run); per-step costs of the
masked-diffusion modes do not depend on the block position, except prefix (its window shrinks as
decoding advances, so early blocks are its most expensive) and SDAR without a cache (its window
grows, so early blocks are its cheapest).

threshold: on a trained model and its eval split: accuracy, tokens committed per step, tokens/s for
the plain schedule (one token per step) and for each threshold / factor setting, with and without the
dual cache.
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
from rl_pieces import public_recipe_denoise  # noqa: E402
from stamp import hardware, header, markdown_table  # noqa: E402
from dare_core.sampling.decode import Canvas, generate  # noqa: E402
from dare_core.sampling.params import SamplingParams  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
# --smoke: 2 small layers of either config (the real special ids lie past the small vocabulary)
SMOKE_SHRINK = {"n_layers": 2, "num_hidden_layers": 2, "d_model": 128, "hidden_size": 128, "mlp_hidden_size": 256,
                "intermediate_size": 256, "n_heads": 4, "n_kv_heads": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "vocab_size": 2048, "embedding_size": 2048, "mask_token_id": 2000,
                "eos_token_id": 2001, "pad_token_id": 2002, "bos_token_id": 2003}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reference_llada(model, prompts, params: SamplingParams, max_blocks: int) -> int:
    """The public LLaDA sampler's per-step work (greedy at temperature 0): returns steps."""
    canvas = Canvas.build(prompts, params, model.mask_token_id, model.pad_token_id, False, next(model.parameters()).device)
    return public_recipe_denoise(model, canvas, params, max_blocks)


def random_model(name: str, device: str, shrink: dict | None):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg.update(shrink or {})
    cfg.setdefault("mask_token_id", 126336 if "LLaDA" in name else 151669)
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    model = build_model(cfg, device=device)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(0)
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    return model.eval()


def time_run(fn, repeats: int = 1) -> tuple[float, object, object]:
    """(seconds per timed run, the warm-up's output, the last run's output)."""
    first = out = fn()  # warm-up (and CUDA-graph capture)
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    sync()
    return (time.perf_counter() - t) / repeats, first, out


def speed(args) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shrink = SMOKE_SHRINK if args.smoke else None
    rows = []
    for name in args.configs:
        model = random_model(name, device, shrink)
        block = model.block_size or 32
        is_block = model.block_size is not None
        modes = (["none", "block_kv eager", "block_kv +graph", "block_kv +graph+compile"] if is_block
                 else ["reference", "none", "prefix", "dual eager", "dual +graph", "dual +graph+compile"])
        for gen in args.gen:
            for batch in args.batch:
                g = torch.Generator().manual_seed(1)
                prompts = torch.randint(10, 1000, (batch, args.prompt), generator=g).tolist()
                steps_per_block = 4 if is_block else block  # SDAR's recipe; LLaDA's one token per step
                params_base = dict(gen_length=gen, block_length=block, steps=gen // block * steps_per_block, stop_at_eos=False)
                max_blocks = max(1, args.steps // steps_per_block)
                for mode in modes:
                    if args.modes and mode not in args.modes:
                        continue
                    if mode == "reference" and batch > 1:
                        continue
                    cache, _, kind = mode.partition(" ")
                    if device == "cpu" and kind.startswith("+graph"):
                        continue
                    params = SamplingParams(**params_base, cache="none" if cache == "reference" else cache,
                                            cuda_graphs=kind.startswith("+graph") if cache in ("dual", "block_kv") else None,
                                            compile_forward=kind.endswith("compile"))
                    if cache == "reference":
                        fn = lambda: reference_llada(model, prompts, params, max_blocks)  # noqa: E731
                    else:
                        fn = lambda: generate(model, prompts, params, max_blocks=max_blocks)  # noqa: E731
                    try:
                        sec, _, out = time_run(fn)
                    except torch.cuda.OutOfMemoryError:
                        rows.append({"model": name, "gen": gen, "batch": batch, "mode": mode, "error": "out of memory"})
                        torch.cuda.empty_cache()
                        continue
                    n_steps = out if isinstance(out, int) else int(out.steps.max())
                    tokens = batch * min(max_blocks, gen // block) * block
                    rows.append({"model": name, "gen": gen, "batch": batch, "mode": mode, "steps": n_steps,
                                 "ms_per_step": sec / n_steps * 1e3, "tokens_per_s": tokens / sec})
                    print(rows[-1], flush=True)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
        model = None  # free the weights before the next config
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def speed_table(rows: list[dict], args) -> list[str]:
    lines = [
        f"Prompt {args.prompt} tokens, greedy; LLaDA: block 32, one token per step; SDAR: block 4, 4 steps per block (static). "
        f"Timed over the first {args.steps} denoising steps of each run, after one warm-up run.",
        "",
    ]
    base = {(r["model"], r["gen"], r["batch"]): r["ms_per_step"] for r in rows if r.get("mode") == "none" and "error" not in r}
    cells = []
    for r in rows:
        what = [r["model"], r["gen"], r["batch"], r["mode"]]
        if "error" in r:
            cells.append(what + ["", r["error"], "", ""])
            continue
        ref = base.get((r["model"], r["gen"], r["batch"]))
        up = f"{ref / r['ms_per_step']:.2f}x" if ref else ""
        cells.append(what + [r["steps"], f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}", up])
    columns = ["model", "gen", "batch", "mode", "steps", "ms / step", "tokens/s", "speed-up vs none"]
    return lines + markdown_table(columns, cells)


def threshold(args) -> list[str]:
    """One table per model (--model may name several: checkpoints compared in one run)."""
    from dare_core.data.schema import read_rows

    data = Path(args.data)
    # a .jsonl copy of the eval split lets the bench run where pyarrow is not installed
    rows = ([json.loads(line) for line in data.read_text().splitlines()] if data.suffix == ".jsonl" else read_rows(data, "eval"))[: args.limit]
    lines = [
        f"{len(rows)} held-out prompts of `{args.data}`, greedy, gen length {args.gen_length}, block "
        f"{args.block_length or args.gen_length}, batch {args.batch_size}. "
        "tokens/s counts response tokens up to and including the first EOS (Fast-dLLM's measure); "
        "tokens/step counts every canvas position the sampler committed. Speed-ups are against the same "
        "model's plain row.",
    ]
    for path in args.model:
        lines += ["", f"### `{path}`", ""] + threshold_table(path, rows, args)
    return lines


def threshold_table(path: str, rows: list[dict], args) -> list[str]:
    from dare_core.rewards.scoring import score_texts
    from dare_core.models.hf_folder import load_model
    from dare_core.models.tokenizer import load_tokenizer
    from dare_core.sampling.decode import decode_responses

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(path, device=device).eval()
    tok = load_tokenizer(path)
    prompts = [tok.encode(r["prompt_text"]) for r in rows]
    gen = args.gen_length
    plain = dict(gen_length=gen, block_length=args.block_length or gen, steps=gen)
    settings = [("plain (1 token/step)", dict(plain))]
    for tau in args.taus:
        settings.append((f"threshold {tau}", dict(plain, unmasking="threshold", threshold=tau)))
    settings.append(("factor 1.0", dict(plain, unmasking="factor", factor=1.0)))
    for tau in args.taus[-2:]:
        settings.append((f"threshold {tau} + dual", dict(plain, unmasking="threshold", threshold=tau, cache="dual")))
    table = []
    for label, kw in settings:
        params = SamplingParams(**kw)

        def run_all(p=params):
            return [generate(model, prompts[i:i + args.batch_size], p) for i in range(0, len(prompts), args.batch_size)]

        sec, _, outs = time_run(run_all)
        texts = [t for o in outs for t in decode_responses(tok, o)]
        acc = sum(r.acc for r in score_texts(rows, texts)) / len(rows)
        steps = sum(int(o.steps.sum()) for o in outs)
        useful = sum(int(o.lengths.sum()) for o in outs)  # up to and including the first EOS
        table.append({"setting": label, "accuracy": acc, "tokens_per_step": len(rows) * gen / steps,
                      "steps": steps / len(rows), "nfe": sum(o.nfe for o in outs), "sec": sec,
                      "tokens_per_s": useful / sec})
        print(path, table[-1], flush=True)
    base = table[0]
    columns = ["setting", "accuracy", "tokens / step", "steps / sample", "tokens/s", "speed-up"]
    return markdown_table(columns, [[r["setting"], f"{r['accuracy']:.3f}", f"{r['tokens_per_step']:.2f}", f"{r['steps']:.1f}",
                                     f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.1f}x"] for r in table])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="part", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--configs", nargs="+", default=["LLaDA-8B-Instruct", "SDAR-8B-Chat"])
    s.add_argument("--gen", nargs="+", type=int, default=[256, 1024])
    s.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    s.add_argument("--prompt", type=int, default=128)
    s.add_argument("--steps", type=int, default=32, help="denoising steps timed per run")
    s.add_argument("--modes", nargs="*", default=[], help="only these modes (e.g. none 'dual +graph')")
    s.add_argument("--smoke", action="store_true", help="2 small layers on CPU: checks the script, measures nothing")
    s.add_argument("--out", default="bench/results/rollout_speed.md")
    t = sub.add_parser("threshold")
    t.add_argument("--model", nargs="+", required=True, help="checkpoint folders, one table each")
    t.add_argument("--data", required=True)
    t.add_argument("--gen-length", type=int, default=6)
    t.add_argument("--block-length", type=int, default=0)
    t.add_argument("--taus", nargs="+", type=float, default=[0.5, 0.7, 0.8, 0.9, 0.95])
    t.add_argument("--limit", type=int, default=500)
    t.add_argument("--batch-size", type=int, default=500)
    t.add_argument("--out", default="bench/results/rollout_threshold.md")
    args = p.parse_args()
    lines = speed_table(speed(args), args) if args.part == "speed" else threshold(args)
    title = ("Denoising step time, random bf16 weights at the real 8B configs" if args.part == "speed"
             else "Threshold decoding on a trained model")
    lines = header(title, "python3 bench/rollout.py " + shlex.join(sys.argv[1:]), hardware()) + lines
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
