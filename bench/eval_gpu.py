"""GSM8K-style evaluation wall time on a GPU: random bf16 weights at the real LLaDA-8B-Instruct
config, 64 fixture prompts, through `EvalModel` (the class OpenCompass calls for every benchmark;
the GPU machine has no OpenCompass, the OpenCompass wrapper adds nothing per token).

    python3 bench/eval_gpu.py --settings none,dual+graph --out bench/results/eval_gpu_a.json
    python3 bench/eval_gpu.py --report bench/results/eval_gpu.json > bench/results/eval_gpu.md

Settings use GSM8K's published LLaDA evaluation: gen length 256, 256 steps, block 8, greedy. The
prompts are the fixture's GSM8K questions with the \\boxed instruction, rendered with the chat
template and tokenised by the char tokenizer (the real LLaDA tokenizer files are not available
here), so a prompt is ~2-3x longer in tokens than with LLaDA's BPE. Random weights never emit EOS,
so every row decodes all 256 tokens. Wall time covers rendering, tokenising, decoding and
detokenising all 64 prompts, after a one-block warm-up of the same batch shape (CUDA-graph
capture, compilation).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from stamp import git_commit, hardware, library_versions, markdown_table, utc_now  # noqa: E402

SETTINGS = {
    "none": {"cache": "none"},
    "prefix": {"cache": "prefix", "cuda_graphs": False},
    "dual": {"cache": "dual", "cuda_graphs": False},
    "dual+graph": {"cache": "dual", "cuda_graphs": True},
    "dual+graph+compile": {"cache": "dual", "cuda_graphs": True, "compile_forward": True},
    "dual+graph+threshold": {"cache": "dual", "cuda_graphs": True, "unmasking": "threshold", "threshold": 0.9},
}
GSM8K = {"gen_length": 256, "steps": 256, "block_length": 8, "temperature": 0.0}


def run(args) -> list[dict]:
    from dare_core.eval.configs import get_benchmark
    from dare_core.eval.lm import EvalModel
    from dare_core.models.tokenizer import char_tokenizer
    from dare_core.sampling.decode import generate
    from eval_fixtures import gsm8k_item, _gsm8k
    from rollout import random_model, sync

    with tempfile.TemporaryDirectory() as tmp:
        _gsm8k(Path(tmp), args.n)
        rows = get_benchmark("gsm8k").load(Path(tmp))
    assert len(rows) == args.n and gsm8k_item(0)
    shrink = {"n_layers": 1, "d_model": 64, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden_size": 64} if args.tiny else None
    model = random_model("LLaDA-8B-Instruct", args.device, shrink)
    tok = char_tokenizer()
    prompts = [[{"role": "user", "content": r["question"]}] for r in rows]
    out = []
    for name in args.settings.split(","):
        settings = {**GSM8K, **SETTINGS[name]}
        lm = EvalModel(ROOT / "bench" / "configs", sampler=settings, batch_size=args.batch_size, model=model, tokenizer=tok)
        ids = [tok.encode(lm.render(p)) for p in prompts]
        warm = sorted(ids, key=len, reverse=True)[:args.batch_size]
        generate(model, warm, lm.sampling_params(), max_blocks=1)  # capture / compile for this batch shape
        sync()
        t = time.perf_counter()
        texts = lm.generate(prompts)
        sync()
        wall = time.perf_counter() - t
        acc = sum(get_benchmark("gsm8k").grade(r, x) for r, x in zip(rows, texts)) / len(rows)
        row = {"setting": name, "sampler": settings, "prompts": len(rows), "batch_size": args.batch_size,
               "prompt_tokens_mean": sum(map(len, ids)) / len(ids), "wall_s": round(wall, 2),
               "tokens_per_s": round(len(rows) * GSM8K["gen_length"] / wall, 1), "accuracy": acc,
               "hardware": hardware(), "commit": git_commit(), "libraries": library_versions(),
               "command": "python3 bench/eval_gpu.py " + shlex.join(sys.argv[1:]), "date": utc_now()}
        print(json.dumps(row), flush=True)
        out.append(row)
        if args.out:  # after every setting: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def run_command(rows: list[dict]) -> str:
    """The command a run's rows came from (runs before the rows recorded it: rebuilt from the
    settings, prompt count and batch size they did record)."""
    if "command" in rows[0]:
        return rows[0]["command"]
    return (f"python3 bench/eval_gpu.py --settings {','.join(r['setting'] for r in rows)} --n {rows[0]['prompts']} "
            f"--batch-size {rows[0]['batch_size']}")


def report(paths: list[str]) -> str:
    """One section per run (per JSON file), each with its own stamp; speed-ups only within a run."""
    lines = ["# GSM8K-style evaluation wall time on a GPU", "",
             f"Written by `python3 bench/eval_gpu.py --report {' '.join(Path(p).name for p in paths)}` from the runs' JSON "
             f"({utc_now()}).", ""]
    for i, path in enumerate(paths):
        rows = json.loads(Path(path).read_text())
        base = next((r["wall_s"] for r in rows if r["setting"] == "none"), None)
        lines += [f"## Run {i}", "", f"Git commit: {rows[0].get('commit', 'unknown (not recorded)')}  ",
                  f"Command: `{run_command(rows)}`  ", f"Hardware: {rows[0]['hardware']}  ",
                  f"Libraries: {rows[0].get('libraries', 'not recorded')}  ", f"Date: {rows[0].get('date', 'not recorded')}", "",
                  f"LLaDA-8B-Instruct config, random bf16 weights, {rows[0]['prompts']} GSM8K fixture prompts "
                  f"(mean {rows[0]['prompt_tokens_mean']:.0f} prompt tokens, char tokenizer), batch {rows[0]['batch_size']}, "
                  "gen length 256, 256 steps, block 8, greedy.", ""]
        lines += markdown_table(["setting", "wall time (s)", "output tokens/s", "vs no cache (this run)"],
                                [[r["setting"], f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.0f}", f"{base / r['wall_s']:.2f}x" if base else ""]
                                 for r in rows])
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="none,dual+graph")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 1-layer model of the same config (smoke test on CPU)")
    p.add_argument("--out")
    p.add_argument("--report", nargs="+")
    args = p.parse_args()
    if args.report:
        print(report(args.report), end="")
        return
    run(args)


if __name__ == "__main__":
    main()
