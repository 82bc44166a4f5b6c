"""The `task` benchmark's scores of an SDAR folder through the `native` and `lmdeploy` rollout engines,
for greedy static and threshold decoding: accuracy, items, wall time, per-item agreement of the two
engines' answers and a verdict on whether they score the same, computed from the rows.

    python3 bench/eval_engines.py --train bench/.models/tiny-sdar      # CPU, minutes: train the model
    python3 bench/eval_engines.py --model bench/.models/tiny-sdar      # GPU: both engines, every item
    python3 bench/eval_engines.py --tiny --train /tmp/m --model /tmp/m # CPU: checks the script

`--train DIR` trains a tiny SDAR from scratch with DARE's own stages (bench/tiny_sdar.py) and writes
the exported folder, with its held-out problems (`eval.parquet`) and `training.json`, to DIR.

Scoring is the eval stage's, without OpenCompass (the GPU machine has none): `EvalModel` (the class
OpenCompass's DareModel wraps, with `engine=`/`engine_args=` as `eval.sampler.engine` passes them)
decodes the benchmark's rows, and the benchmark's own grader (what DareEvaluator calls) scores them.
One model is loaded and serves every row; the lmdeploy engine decodes with its weights. Each row is
one EvalModel: a warm-up pass over the first batch (lmdeploy starts its engine, which fixes the
sampler; native captures its CUDA graphs), then the timed pass over every item. Rows are written as
they finish; a row that cannot run (no CUDA, lmdeploy not importable, any error) is a row saying why,
its traceback in the log file beside the results.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_engines_report import describe_model, shown, write_results  # noqa: E402
from stamp import REPO, git_commit, hardware, library_versions, utc_now  # noqa: E402

ENGINES = ("native", "lmdeploy")
# our unmasking rule per bench sampler (lmdeploy: low_confidence_static / low_confidence_dynamic)
UNMASKING = {"static": "topk", "threshold": "threshold"}
# the arithmetic task's answer: 4 digits + EOS, rounded up to whole blocks of 4
GEN_LENGTH = 8
CPU_ITEMS, TINY_ITEMS = 64, 16


def sampler(name: str, gen_length: int, block: int, threshold: float) -> dict:
    """Every setting of the named sampler, so nothing comes from the folder's own generation_config:
    greedy picks, confidence = untempered softmax (what lmdeploy reads), block KV cache; `static`
    commits one token per step (steps = gen_length), `threshold` every position at least `threshold`
    sure (at least one)."""
    from dare_core.sampling.params import SamplingParams

    params = SamplingParams(gen_length=gen_length, steps=gen_length, block_length=block, temperature=0.0,
                            remasking="low_confidence", unmasking=UNMASKING[name], threshold=threshold, cache="block_kv")
    return dataclasses.asdict(params)


def task_items(data: Path, n: int) -> list[dict]:
    """The `task` benchmark's rows of a prepared eval file (or a folder holding eval.parquet), the first n (0: all)."""
    from dare_core.eval.configs import get_benchmark

    return get_benchmark("task").load(data, max_samples=n)


def grade(items: list[dict], texts: list[str]) -> list[float]:
    from dare_core.eval.configs import get_benchmark

    bench = get_benchmark("task")
    return [bench.grade(item, text or "") for item, text in zip(items, texts)]


def measure(engine: str, name: str, args, model, tokenizer, items: list[dict], log_error: Callable) -> dict:
    """One row: `engine` decoding every item with sampler `name`."""
    import torch

    from dare_core.eval.lm import EvalModel

    settings = sampler(name, args.gen_length, model.block_size, args.threshold)
    row = {"engine": engine, "sampler": name, "items": len(items), "settings": settings}
    engine_args = {"max_batch_size": args.batch_size, "dtype": args.dtype, **args.lmdeploy_args} if engine == "lmdeploy" else {}
    prompts = [item["question"] for item in items]  # `task` prompts are used as prepared (no chat template)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    lm = None
    try:
        t0 = time.perf_counter()
        lm = EvalModel(args.model, sampler=settings, chat=False, seed=0, dtype=args.dtype, device=args.device,
                       batch_size=args.batch_size, engine=engine, engine_args=engine_args, model=model, tokenizer=tokenizer)
        lm.generate(prompts[:args.batch_size])
        sync()
        row["start_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        texts = lm.generate(prompts)
        sync()
        row["wall_s"] = time.perf_counter() - t1
        row["engine_info"] = getattr(lm.engine, "info", None)
    except Exception as e:  # the row says why; the other rows still run
        row["error"] = f"{type(e).__name__}: {e}"
        log_error(f"{engine} / {name}", traceback.format_exc())
        return row
    finally:
        close = getattr(getattr(lm, "engine", None), "close", None)
        if close is not None:
            close()
    scores = grade(items, texts)
    row.update(correct=int(sum(scores)), accuracy=sum(scores) / len(scores), predictions=texts, scores=scores)
    return row


def evaluate(args) -> int:
    import torch

    from dare_core.devices import resolve_dtype
    from dare_core.models.hf_folder import load_model
    from dare_core.models.tokenizer import load_tokenizer

    args.model = args.model.resolve()
    args.data = (args.data or args.model / "eval.parquet").resolve()
    if not args.data.exists():
        raise SystemExit(f"{args.data}: no prepared eval file; give --data (a `dare stage prepare` eval.parquet)")
    if args.tiny:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, whose spin-waits crawl on a shared CPU
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    n = args.n if args.n is not None else (TINY_ITEMS if args.tiny else 0 if cuda else CPU_ITEMS)
    items = task_items(args.data, n)
    model = load_model(args.model, dtype=resolve_dtype(args.dtype), device=args.device).eval()
    if model.block_size is None:
        raise SystemExit(f"{args.model}: not a block-diffusion (SDAR) folder; lmdeploy decodes SDAR only")
    tokenizer = load_tokenizer(args.model)
    args.block = model.block_size
    training_file = args.model / "training.json"
    args.training = json.loads(training_file.read_text()) if training_file.exists() else None
    args.model_line = describe_model(model, args.training)
    where = f"of the `task` benchmark's rows in `{shown(args.data)}` (held-out problems)"
    args.items_line = f"the first {len(items)} {where}" if n else f"all {len(items)} {where}"
    args.log, args.errors_logged = args.out.with_suffix(".log"), False
    args.log.unlink(missing_ok=True)  # the tracebacks of this run only

    def log_error(what: str, text: str) -> None:
        with args.log.open("a") as f:
            f.write(f"=== {what} ({utc_now()})\n{text}\n")
        args.errors_logged = True
        print(f"[eval_engines] {what} failed; traceback in {args.log}", flush=True)

    rows: list[dict] = []
    plan = [(e, s) for e in args.engines for s in args.samplers]  # native first: its rows survive a crash in lmdeploy
    for i, (engine, name) in enumerate(plan):
        write_results(args, rows, f"running: {engine} / {name} ({i + 1} of {len(plan)} rows)")
        row = measure(engine, name, args, model, tokenizer, items, log_error)
        rows.append(row)
        print(f"[eval_engines] {engine} / {name}: " + (row["error"] if "error" in row else
              f"accuracy {row['accuracy']:.3f} over {row['items']} items, {row['wall_s']:.2f} s"), flush=True)
    failed = [f"{r['engine']} / {r['sampler']}" for r in rows if "error" in r]
    write_results(args, rows, "finished" + (f"; rows that did not run: {', '.join(failed)}" if failed else ""))
    print(f"[eval_engines] wrote {args.out}", flush=True)
    return 1 if any(r["engine"] == "native" and "error" in r for r in rows) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", type=Path, metavar="DIR", help="train a tiny SDAR from scratch (bench/tiny_sdar.py) into DIR")
    ap.add_argument("--steps", type=int, help="SFT steps of --train (default 1200; --tiny 5)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="--train: settings over the bench's, as -S takes them")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/eval_engines"), help="--train: the stages' data, runs and logs")
    ap.add_argument("--model", type=Path, metavar="DIR", help="evaluate this SDAR folder (after --train, if both)")
    ap.add_argument("--data", type=Path, help="a prepared eval file or folder (default: the model folder's eval.parquet)")
    ap.add_argument("--n", type=int, help=f"items (0: all; default all on CUDA, {CPU_ITEMS} on CPU, {TINY_ITEMS} with --tiny)")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--samplers", nargs="+", choices=list(UNMASKING), default=list(UNMASKING))
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--gen-length", type=int, default=GEN_LENGTH)
    ap.add_argument("--batch-size", type=int, default=250)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="both engines' (default: bfloat16 on CUDA, else float32)")
    ap.add_argument("--device", help="native's device (default: cuda if there is one)")
    ap.add_argument("--lmdeploy-args", type=json.loads, default={}, help="engine_args of lmdeploy as JSON, e.g. '{\"python\": ...}'")
    ap.add_argument("--tolerance", type=float, default=0.01, help="largest accuracy difference that counts as the same score")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "eval_engines.md")
    ap.add_argument("--tiny", action="store_true", help="CPU check: --train a two-layer narrow model for 5 steps; few items")
    args = ap.parse_args()
    if not (args.train or args.model):
        ap.error("give --train DIR, --model DIR or both")
    args.command = "python3 bench/eval_engines.py " + shlex.join(sys.argv[1:])
    if args.train:
        import tiny_sdar

        record = tiny_sdar.train(args.train, args.workdir, args.steps, args.tiny, args.set, args.command)
        print(f"[eval_engines] trained {args.train}: {record['sft_steps']} SFT steps in {record['sft_seconds']} s "
              f"(all stages {record['total_seconds']} s), OpenCompass {record['opencompass_accuracy']}, "
              f"{record['size_bytes'] / 2**20:.1f} MiB", flush=True)
    if not args.model:
        return 0
    args.commit, args.hardware, args.date = git_commit(), hardware(), utc_now()
    args.libraries = library_versions(("torch", "transformers", "lmdeploy", "opencompass"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return evaluate(args)


if __name__ == "__main__":
    sys.exit(main())
