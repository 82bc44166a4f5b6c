"""SDAR-8B rollouts through our block-KV loop (`native`) and lmdeploy's engine, on the same weights,
prompts and greedy settings in one run: ms/step, tokens/s, greedy agreement, and the default engine
for SDAR rollouts with its reason, computed from the rows.

    python3 bench/rollout_engines.py --budget 540      # GPU: the whole grid in one command
    python3 bench/rollout_engines.py --tiny            # CPU: two narrow layers, checks the script

Weights: random bf16 at the real SDAR-8B-Chat config, written once under --workdir in the real on-disk
format with a tokenizer (bench/train_step_setup.py), read by both engines (--model: a checkpoint folder
instead). Drawn with std --init-std 0.3, not 0.02: at 0.02 the logits are near-uniform over 152k ids,
so bf16 rounding decides each greedy pick (the agreement would measure kernel noise) and no confidence
reaches a threshold (dynamic unmasking would commit one token per step); at 0.3 the top logit stands
clear, as a trained model's does. Block 4 and 4 steps per block (SDAR's recipe), confidence the
untempered softmax (`low_confidence`, what lmdeploy reads), stop_at_eos off: every run decodes all gen
tokens. Static = our `topk` (lmdeploy `low_confidence_static`), dynamic = our `threshold` (lmdeploy
`low_confidence_dynamic`). One warm-up per setting (CUDA graphs, lmdeploy's start), then --repeats.

Processes: the native rows run here; the native model is then freed and each unmasking's lmdeploy rows
run in a child process (lmdeploy fixes the unmasking when its engine starts). A child because the
native run's allocator cache and CUDA-graph pools are surely returned only when a process ends, and
lmdeploy sizes its KV cache as a share of the GPU memory it finds free (16 GB of native weights still
held would shrink it); a crash there keeps the native rows too. Rows come back as JSON lines; the
results file and its JSON are rewritten after every row, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import time_run  # noqa: E402
from stamp import REPO, fmt, git_commit, hardware, header, jsonl_rows, library_versions, markdown_table, write_atomic  # noqa: E402
from dare_core.sampling.params import SamplingParams  # noqa: E402

UNMASKINGS = {"static": "topk", "dynamic": "threshold"}  # bench name -> ours (map_params gives lmdeploy's)
STEPS_PER_BLOCK = 4
GRID = {"batch": [1, 32, 128], "gen": [256, 1024], "prompt": 128}
TINY = {"batch": [1, 2], "gen": [8, 16], "prompt": 8}


def sampling_params(unmasking: str, gen: int, block: int, threshold: float, cuda: bool) -> SamplingParams:
    return SamplingParams(gen_length=gen, block_length=block, steps=gen // block * STEPS_PER_BLOCK, temperature=0.0,
                          remasking="low_confidence", unmasking=UNMASKINGS[unmasking], threshold=threshold,
                          cache="block_kv", cuda_graphs=cuda, stop_at_eos=False)


def make_prompts(batch: int, length: int) -> list[list[int]]:
    """The same prompts for both engines: ids 10..199 exist in every vocabulary here, none special."""
    return torch.randint(10, 200, (batch, length), generator=torch.Generator().manual_seed(batch)).tolist()


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(fraction of positions holding the same token, fraction of rows equal throughout) of two [B, L]."""
    if a.shape != b.shape:
        raise ValueError(f"responses of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    same = a.cpu() == b.cpu()
    return same.float().mean().item(), same.all(-1).float().mean().item()


def key(unmasking: str, gen: int, batch: int) -> str:
    return f"{unmasking}-{gen}-{batch}"


def result_row(engine: str, point: tuple, wall: float, steps: Optional[int], first, out, native: Optional[torch.Tensor]) -> dict:
    unmasking, gen, batch = point
    row = {"engine": engine, "unmasking": unmasking, "gen": gen, "batch": batch, "wall_s": wall, "steps": steps,
           "ms_per_step": wall / steps * 1e3 if steps else None, "tokens_per_s": batch * gen / wall,
           "repeat_agreement": agreement(first.response, out.response)[0]}
    if native is not None:
        row["token_agreement"], row["row_agreement"] = agreement(out.response, native)
    return row


def failed_row(engine: str, point: tuple, error: str) -> dict:
    unmasking, gen, batch = point
    return {"engine": engine, "unmasking": unmasking, "gen": gen, "batch": batch, "error": error}


def past(deadline: Optional[float]) -> bool:
    return deadline is not None and time.time() > deadline


def native_rows(folder: Path, grid: list, args, emit: Callable) -> tuple[dict, bool]:
    """Runs the grid on our loop; returns ({key: response tokens on the CPU}, stopped by the budget)."""
    from dare_core.models.hf_folder import load_model
    from dare_core.sampling.decode import generate

    cuda = torch.cuda.is_available()
    model = load_model(folder, dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu").eval()
    tokens, stopped = {}, False
    for point in grid:
        if past(args.deadline):
            stopped = True
            break
        params = sampling_params(point[0], point[1], model.block_size, args.threshold, cuda)
        prompts = make_prompts(point[2], args.prompt)
        try:
            wall, first, out = time_run(lambda: generate(model, prompts, params), args.repeats)
        except torch.cuda.OutOfMemoryError:
            emit(failed_row("native", point, "out of memory"))
            torch.cuda.empty_cache()
            continue
        tokens[key(*point)] = out.response.cpu()
        emit(result_row("native", point, wall, int(out.steps.max()), first, out, None))
    model = None  # the weights go before lmdeploy's children start
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return tokens, stopped


def lmdeploy_missing() -> Optional[str]:
    """Why lmdeploy cannot run here (None: it can)."""
    from dare_core.sampling.engines.lmdeploy import INSTALL_HINT, _import_lmdeploy

    try:
        _import_lmdeploy()
    except ImportError as e:
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        return f"lmdeploy could not be imported{cause}; {e}"
    if not torch.cuda.is_available():
        return f"no CUDA GPU here; {INSTALL_HINT}"
    return None


def lmdeploy_child(spec_path: Path) -> int:
    """One unmasking's lmdeploy rows (one engine), appended to spec['rows'] as JSON lines."""
    from dare_core.models.lm import build_model
    from dare_core.sampling.engines import build_engine

    spec = json.loads(spec_path.read_text())
    folder, unmasking = Path(spec["folder"]), spec["unmasking"]
    # the engine reads only the config's ids and sizes from the model: no weights on the GPU twice
    model = build_model(json.loads((folder / "config.json").read_text()), device="meta")
    native = torch.load(spec["tokens"]) if Path(spec["tokens"]).exists() else {}
    engine = build_engine("lmdeploy", model, model_path=str(folder), cache_max_entry_count=spec["cache_max_entry_count"],
                          max_batch_size=max(b for _, b in spec["points"]), distributed_executor_backend=spec["backend"])
    not_started = None
    with open(spec["rows"], "a") as rows:
        for gen, batch in spec["points"]:
            if past(spec["deadline"]):
                break
            point = (unmasking, gen, batch)
            params = sampling_params(unmasking, gen, model.block_size, spec["threshold"], True)
            prompts = make_prompts(batch, spec["prompt"])
            if not_started:
                row = failed_row("lmdeploy", point, f"not run: the engine did not start: {not_started}")
            else:
                try:
                    wall, first, out = time_run(lambda: engine.generate(prompts, params), spec["repeats"])
                    steps = gen // model.block_size * STEPS_PER_BLOCK if unmasking == "static" else None  # not reported
                    row = result_row("lmdeploy", point, wall, steps, first, out, native.get(key(*point)))
                except Exception as e:  # the row says what failed; the other settings still run
                    # an OOM in lmdeploy's worker process arrives as its error's text
                    oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
                    row = failed_row("lmdeploy", point, "out of memory" if oom else f"{type(e).__name__}: {e}"[:500])
                    if engine._engine is None:
                        not_started = row["error"]
            rows.write(json.dumps(row) + "\n")
            rows.flush()
    engine.close()
    return 0


def run_lmdeploy(args, folder: Path, grid: list, on_rows: Callable) -> Optional[str]:
    """Each unmasking's child in turn; returns what went wrong (None: nothing)."""
    rows_path, problems = args.workdir / "lmdeploy_rows.jsonl", []
    rows_path.unlink(missing_ok=True)
    for unmasking in args.unmasking:
        if past(args.deadline):
            break
        spec = {"folder": str(folder), "unmasking": unmasking, "points": [(g, b) for u, g, b in grid if u == unmasking],
                "rows": str(rows_path), "tokens": str(args.workdir / "native_tokens.pt"), "threshold": args.threshold,
                "prompt": args.prompt, "repeats": args.repeats, "deadline": args.deadline, "backend": args.lmdeploy_backend,
                "cache_max_entry_count": args.cache_max_entry_count}
        spec_path = args.workdir / f"lmdeploy_{unmasking}.json"
        spec_path.write_text(json.dumps(spec))
        log = args.workdir / f"lmdeploy_{unmasking}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, __file__, "--lmdeploy-child", str(spec_path)], cwd=REPO,
                                    stdout=out, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                on_rows(jsonl_rows(rows_path))
                time.sleep(2)
        on_rows(jsonl_rows(rows_path))
        if proc.returncode:
            tail = " / ".join(line for line in log.read_text(errors="replace").splitlines()[-3:] if line.strip())[-400:]
            problems.append(f"the lmdeploy {unmasking} child exited with code {proc.returncode} ({log}): {tail}")
    return "; ".join(problems) or None


def verdict(rows: list[dict], min_agreement: float, not_run: Optional[str]) -> tuple[dict, list[str]]:
    """({default, reason}, the verdict section's lines), from the finished native/lmdeploy pairs."""
    done = {(r["engine"], key(r["unmasking"], r["gen"], r["batch"])): r for r in rows if "error" not in r}
    pairs = [(done[("native", k)], r) for (e, k), r in done.items() if e == "lmdeploy" and ("native", k) in done]
    if not pairs:
        why = not_run or next((r["error"] for r in rows if r["engine"] == "lmdeploy" and "error" in r), "no lmdeploy row ran")
        reason = f"lmdeploy was not measured: {why}"
        return {"default": "native", "reason": reason}, [f"Default for SDAR rollouts: **native** (unchanged), because {reason}."]
    cells, ratios = [], []
    for n, m in pairs:
        ratio = m["tokens_per_s"] / n["tokens_per_s"]
        ratios.append(ratio)
        cells.append([n["unmasking"], n["batch"], n["gen"], f"{n['tokens_per_s']:,.0f}", f"{m['tokens_per_s']:,.0f}",
                      f"{ratio:.2f}x", "lmdeploy" if ratio > 1 else "native", f"{m['token_agreement']:.3f}"])
    speed = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    agree = sum(m["token_agreement"] for _, m in pairs) / len(pairs)
    over = f"geometric mean of tokens/s over {len(pairs)} setting(s)"
    if speed > 1 and agree >= min_agreement:
        default, reason = "lmdeploy", (f"lmdeploy is {speed:.2f}x as fast as native ({over}) and its greedy tokens equal "
                                       f"native's at {agree:.1%} of positions (>= {min_agreement:.0%})")
    elif speed > 1:
        default, reason = "native", (f"lmdeploy is {speed:.2f}x as fast ({over}) but its greedy tokens equal native's at only "
                                     f"{agree:.1%} of positions (< {min_agreement:.0%})")
    else:
        default, reason = "native", f"native is {1 / speed:.2f}x as fast as lmdeploy ({over}); greedy agreement {agree:.1%}"
    lines = markdown_table(["unmasking", "batch", "gen", "native tokens/s", "lmdeploy tokens/s", "lmdeploy / native",
                            "faster", "token agreement"], cells)
    lines += ["", f"Default for SDAR rollouts: **{default}**, because {reason}. Either way, rollouts that record per-step "
              "commits or use our `dynamic` unmasking stay on native: lmdeploy cannot do them (`map_params` refuses)."]
    return {"default": default, "reason": reason}, lines


def write_results(args, rows: list[dict], status: str, not_run: Optional[str]) -> None:
    decided, verdict_lines = verdict(rows, args.min_agreement, not_run)
    cells = []
    for r in rows:
        what = [r["engine"], f"{r['unmasking']} ({UNMASKINGS[r['unmasking']]})", r["batch"], r["gen"]]
        if "error" in r:
            cells.append(what + [""] * 7 + [r["error"]])
            continue
        steps = r["steps"] if r["steps"] is not None else "unknown (not reported)"
        missing = "(reference)" if r["engine"] == "native" else "n/a (no native row)"
        cells.append(what + [f"{r['wall_s']:.3f}", steps, fmt(r["ms_per_step"], ".2f"), f"{r['tokens_per_s']:,.1f}",
                             *(fmt(r.get(k), ".3f", missing) for k in ("token_agreement", "row_agreement")),
                             f"{r['repeat_agreement']:.3f}", ""])
    lines = header("SDAR rollouts: native block_kv vs lmdeploy", args.command, args.hardware, args.commit, args.libraries)
    lines += [f"- Weights: {args.weights}. Prompt {args.prompt} random ids (the same for both engines), greedy, block 4, "
              f"{STEPS_PER_BLOCK} steps per block, stop_at_eos off; dynamic threshold {args.threshold}. Native: cache block_kv, "
              f"CUDA graphs {'on' if torch.cuda.is_available() else 'off (CPU)'}. lmdeploy: executor {args.lmdeploy_backend}, "
              f"cache_max_entry_count {args.cache_max_entry_count}. One warm-up, then {args.repeats} timed run(s) per row.",
              "- tokens/s = batch x gen / wall. Agreement: lmdeploy's response tokens against native's at the same setting "
              "(positions equal, rows equal throughout); repeat agreement: the last timed run against the warm-up.",
              f"- Status: {status}.", "", "## Rows", ""]
    lines += markdown_table(["engine", "unmasking", "batch", "gen", "wall s", "denoising steps", "ms / step", "tokens/s",
                             "agreement (tokens)", "agreement (rows)", "repeat agreement", "note"], cells)
    lines += ["", "## Verdict", ""] + verdict_lines
    write_atomic(args.out, "\n".join(lines) + "\n")
    write_atomic(args.out.with_suffix(".json"), json.dumps({"commit": args.commit, "command": args.command, "status": status,
                                                            "verdict": decided, "rows": rows}, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", nargs="+", type=int)
    ap.add_argument("--gen", nargs="+", type=int)
    ap.add_argument("--prompt", type=int)
    ap.add_argument("--unmasking", nargs="+", choices=list(UNMASKINGS), default=list(UNMASKINGS))
    ap.add_argument("--threshold", type=float, default=0.9, help="dynamic unmasking's confidence threshold")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", type=Path, help="a checkpoint folder for both engines (default: random weights)")
    ap.add_argument("--init-std", type=float, default=0.3, help="std of the random weights")
    ap.add_argument("--min-agreement", type=float, default=0.9, help="token agreement lmdeploy needs to become the default")
    ap.add_argument("--lmdeploy-backend", default="ray", help="lmdeploy's executor (ray: what training's weight updates need)")
    ap.add_argument("--cache-max-entry-count", type=float, default=0.5, help="lmdeploy's KV cache share of free GPU memory")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rollout_engines"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rollout_engines.md")
    ap.add_argument("--budget", type=float, default=0, help="seconds after which no new row starts (0: no limit)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: two narrow layers, a tiny grid")
    ap.add_argument("--lmdeploy-child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lmdeploy_child:
        return lmdeploy_child(args.lmdeploy_child)
    from train_step_setup import write_model_folder

    if args.tiny:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, whose spin-waits crawl on a shared CPU
    for name, value in (TINY if args.tiny else GRID).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.deadline = time.time() + args.budget if args.budget else None
    args.libraries = library_versions(("torch", "lmdeploy", "ray", "transformers"))
    args.hardware, args.commit, args.command = hardware(), git_commit(), "python3 bench/rollout_engines.py " + shlex.join(sys.argv[1:])
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    folder = args.model or args.workdir / "models" / f"sdar{'-tiny' if args.tiny else ''}-std{args.init_std:g}"
    args.weights = (f"checkpoint `{args.model}`" if args.model else
                    f"random, normal std {args.init_std:g}, at the SDAR-8B-Chat config{' shrunk (--tiny)' if args.tiny else ''}")
    if not args.model and not (folder / "config.json").exists():
        print(f"[rollout_engines] writing random weights to {folder} ...", flush=True)
        write_model_folder("sdar", folder, args.tiny, std=args.init_std)
    grid = [(u, g, b) for u in args.unmasking for g in args.gen for b in args.batch]
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(f"[rollout_engines] {row}", flush=True)
        write_results(args, rows, "running", None)

    tokens, stopped = native_rows(folder, grid, args, emit)
    torch.save(tokens, args.workdir / "native_tokens.pt")
    native_count, problem = len(rows), None
    not_run = f"--budget {args.budget:g} s ran out before lmdeploy started" if stopped else lmdeploy_missing()

    def child_rows(done: list[dict]) -> None:
        rows[native_count:] = done
        write_results(args, rows, "running", None)

    if not_run:
        rows += [failed_row("lmdeploy", p, f"not run: {not_run}") for p in grid]
    else:
        problem = run_lmdeploy(args, folder, grid, child_rows)
    measured = sum("error" not in r or r["error"] == "out of memory" for r in rows)
    cut = past(args.deadline) and len(rows) < 2 * len(grid)
    status = (f"stopped by --budget {args.budget:g} s after {measured} of {2 * len(grid)} rows" if stopped or cut
              else "finished") + (f"; {problem}" if problem else "")
    write_results(args, rows, status, not_run)
    print(f"[rollout_engines] {status}; wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
