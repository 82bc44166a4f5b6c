"""SDAR rollouts through our block-KV loop (`native`) and lmdeploy's engine, on the same weights and
prompts in one run: speed over a grid, teacher-forced logit parity, greedy agreement, and the
default engine for SDAR rollouts with its reason, computed from the rows.

    python3 bench/rollout_engines.py --side-by-side --budget 480     # GPU x2: the whole grid, both engines at once
    python3 bench/rollout_engines.py --tiny                          # CPU: two narrow layers, checks the script

Weights: random bf16 at the real SDAR-8B-Chat config, written once under --workdir in the real
on-disk format with a tokenizer (bench/train_step_setup.py), read by both engines. The grid runs on
the first --init-std (0.3: at 0.02 the logits are near-uniform over 152k ids and no confidence
reaches a threshold, so dynamic unmasking would commit one token per step). Block 4 and 4 steps per
block (SDAR's recipe), greedy, confidence the untempered softmax (`low_confidence`, what lmdeploy
reads), stop_at_eos off: every run decodes all gen tokens. Static = our `topk` (lmdeploy
`low_confidence_static`), dynamic = our `threshold` (lmdeploy `low_confidence_dynamic`). One warm-up
per setting (CUDA graphs), then --repeats timed runs.

Parity (docs/sampling.md#engines): lmdeploy decodes --parity-prompts prompts one at a time with its
probe on (the logits of each of its forwards); DARE's model then reads exactly the same tokens at the
same positions (`engines/lmdeploy/parity.py`), giving the logit error and the argmax agreement, over
all rows and over the rows whose top-2 gap is clear of the error. Then both engines decode the same
prompts greedily: the agreement of whole trajectories, and where they first part. Parity runs on
every --init-std and on each --parity-model (a trained checkpoint: real margins).

Processes: each engine's rows come from a worker process of this script (its own GPU with
--side-by-side, else one after the other), so that each starts with an empty GPU: lmdeploy sizes its
KV cache as a share of the memory it finds free. lmdeploy itself runs in its own process, started by
the engine. Rows come back as JSON lines and the results file and its JSON are rewritten after every
row, so a run cut short keeps what it measured; an error keeps its traceback in the JSON and the log.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

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
MIN_PARITY = 0.99  # teacher-forced argmax agreement an engine needs to become the default (over clear rows)


def sampling_params(unmasking: str, gen: int, block: int, threshold: float, cuda: bool) -> SamplingParams:
    return SamplingParams(gen_length=gen, block_length=block, steps=gen // block * STEPS_PER_BLOCK, temperature=0.0,
                          remasking="low_confidence", unmasking=UNMASKINGS[unmasking], threshold=threshold,
                          cache="block_kv", cuda_graphs=cuda, stop_at_eos=False)


def make_prompts(batch: int, length: int, vocab: int = 200, special: tuple = (), seed: Optional[int] = None) -> list[list[int]]:
    """The same prompts for both engines: ids from 10 up to min(vocab, 200), none special."""
    allowed = torch.tensor([i for i in range(10, min(vocab, 200)) if i not in special])
    g = torch.Generator().manual_seed(batch if seed is None else seed)
    return allowed[torch.randint(len(allowed), (batch, length), generator=g)].tolist()


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(fraction of positions holding the same token, fraction of rows equal throughout) of two [B, L]."""
    if a.shape != b.shape:
        raise ValueError(f"responses of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    same = a.cpu() == b.cpu()
    return same.float().mean().item(), same.all(-1).float().mean().item()


def first_difference(a: torch.Tensor, b: torch.Tensor) -> list[Optional[int]]:
    """Per row, the first position where two responses differ (None: equal)."""
    diff = a.cpu() != b.cpu()
    return [int(d.nonzero()[0]) if d.any() else None for d in diff]


def key(unmasking: str, gen: int, batch: int) -> str:
    return f"{unmasking}-{gen}-{batch}"


def past(deadline: Optional[float]) -> bool:
    return deadline is not None and time.time() > deadline


def error_row(what: dict, exc: BaseException) -> dict:
    """A row saying what failed, its traceback kept (printed to the worker's log too)."""
    tb = traceback.format_exc()
    print(tb, flush=True)
    oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
    return {**what, "error": "out of memory" if oom else f"{type(exc).__name__}: {exc}"[:400], "traceback": tb}


# ---- the workers (one process each)

def grid_worker(spec: dict, emit) -> None:
    """One engine's grid rows: native in this process, lmdeploy one engine per unmasking."""
    from dare_core.models.hf_folder import load_model
    from dare_core.sampling.decode import generate

    cuda = torch.cuda.is_available()
    folder, engine_name = Path(spec["folder"]), spec["engine"]
    tokens: dict = {}
    if engine_name == "native":
        model = load_model(folder, dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu").eval()
    for unmasking in spec["unmasking"]:
        engine, not_started = None, None
        for gen, batch in spec["points"]:
            point = {"engine": engine_name, "unmasking": unmasking, "gen": gen, "batch": batch}
            if past(spec["deadline"]) or not_started:
                emit({**point, "error": not_started or "not run: --budget ran out"})
                continue
            prompts = make_prompts(batch, spec["prompt"])
            try:
                if engine_name == "native":
                    params = sampling_params(unmasking, gen, model.block_size, spec["threshold"], cuda)
                    run = lambda: generate(model, prompts, params)  # noqa: E731
                else:
                    engine = engine or lmdeploy_engine(folder, spec, max(b for _, b in spec["points"]))
                    params = sampling_params(unmasking, gen, engine.model.block_size, spec["threshold"], True)
                    run = lambda: engine.generate(prompts, params)  # noqa: E731
                wall, first, out = time_run(run, spec["repeats"])
            except Exception as e:  # the row says what failed; the other settings still run
                row = error_row(point, e)
                emit(row)
                if engine_name == "lmdeploy" and (engine is None or engine.process is None):
                    not_started, engine = f"not run: the engine did not start: {row['error']}", None
                continue
            tokens[key(unmasking, gen, batch)] = out.response.cpu()
            steps = int(out.steps.max()) if engine_name == "native" else (gen // 4 * STEPS_PER_BLOCK if unmasking == "static" else None)
            emit({**point, "wall_s": wall, "steps": steps, "ms_per_step": wall / steps * 1e3 if steps else None,
                  "tokens_per_s": batch * gen / wall, "repeat_agreement": agreement(first.response, out.response)[0],
                  **({"engine_info": engine.info, "start_s": engine.info.get("start_seconds")} if engine is not None else {})})
            torch.save(tokens, spec["tokens"] + ".tmp")
            os.replace(spec["tokens"] + ".tmp", spec["tokens"])  # the parent reads it while this runs
        if engine is not None and unmasking == "static" and spec.get("parity"):
            emit(parity_row(engine, folder, spec, spec["parity"]))
        if engine is not None:
            engine.close()


def lmdeploy_engine(folder: Path, spec: dict, max_batch: int):
    """lmdeploy on `folder`, its process started: the bench's meta model carries only the config."""
    from dare_core.models.lm import build_model
    from dare_core.sampling.engines import build_engine

    model = build_model(json.loads((folder / "config.json").read_text()), device="meta")
    return build_engine("lmdeploy", model, model_path=str(folder), cache_max_entry_count=spec["cache_max_entry_count"],
                        max_batch_size=max_batch, log_dir=spec["workdir"])


def parity_row(engine, folder: Path, spec: dict, settings: dict) -> dict:
    """Teacher-forced parity and greedy agreement of `engine` (started, static unmasking) with DARE's
    model of `folder` (module docstring)."""
    from dare_core.models.hf_folder import load_model
    from dare_core.sampling.decode import generate
    from dare_core.sampling.engines.lmdeploy.parity import compare, replay_logits

    row = {"engine": "lmdeploy", "kind": "parity", "weights": settings["weights"], "gen": settings["gen"],
           "prompts": settings["prompts"]}
    try:
        model = load_model(folder, dtype=torch.bfloat16, device="cuda").eval()
        special = (model.mask_token_id, model.eos_token_id, model.pad_token_id)
        # a small model's context may not hold the settings: half of it for the response at most
        gen = min(settings["gen"], model.max_sequence_length // 2 // model.block_size * model.block_size)
        length = min(spec["prompt"], model.max_sequence_length - gen - 2 * model.block_size)
        prompts = make_prompts(settings["prompts"], length, model.config.vocab_size, special, seed=7)
        params = sampling_params("static", gen, model.block_size, spec["threshold"], True)
        row["gen"] = gen
        engine.probe(True)
        for p in prompts:  # one request at a time: each record is one sequence
            engine.generate([p], params)
        records = engine.take_records()
        engine.probe(False)
        row.update(compare(*replay_logits(model, records, torch.device("cuda"))), forwards=len(records))
        ours, theirs = generate(model, prompts, params).response, engine.generate(prompts, params).response
        row["greedy_token_agreement"], row["greedy_row_agreement"] = agreement(theirs, ours)
        row["first_difference"] = first_difference(theirs, ours)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    except Exception as e:
        return error_row(row, e)
    return row


def parity_worker(spec: dict, emit) -> None:
    """Parity on further weights (other --init-std, --parity-model), one engine each."""
    for folder, weights in spec["folders"]:
        what = {"engine": "lmdeploy", "kind": "parity", "weights": weights}
        if past(spec["deadline"]):
            emit({**what, "error": "not run: --budget ran out"})
            continue
        try:
            engine = lmdeploy_engine(Path(folder), spec, spec["parity"]["prompts"])
            block, most = engine.model.block_size, engine.model.max_sequence_length
            warm = sampling_params("static", min(spec["parity"]["gen"], most // 2 // block * block), block, spec["threshold"], True)
            engine.generate([[10] * block], warm)  # starts it with the parity run's settings
        except Exception as e:
            emit(error_row(what, e))
            continue
        emit(parity_row(engine, Path(folder), spec, {**spec["parity"], "weights": weights}))
        engine.close()


def worker_main(kind: str, spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    with open(spec["rows"], "a") as rows:
        def emit(row: dict) -> None:
            rows.write(json.dumps(row) + "\n")
            rows.flush()
            print(f"[rollout_engines:{kind}] {({k: v for k, v in row.items() if k != 'traceback'})}", flush=True)

        (grid_worker if kind == "grid" else parity_worker)(spec, emit)
    return 0


# ---- the parent: workers, then the results file

def start_worker(args, name: str, kind: str, spec: dict, gpu: Optional[int]) -> tuple[subprocess.Popen, Path]:
    spec_path, log = args.workdir / f"{name}.json", args.workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}))
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", kind, str(spec_path)], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def lmdeploy_missing() -> Optional[str]:
    from dare_core.sampling.engines.lmdeploy import unavailable

    return unavailable()


def with_agreement(rows: list[dict], tokens: dict[str, dict]) -> list[dict]:
    """lmdeploy rows with their greedy agreement against native's tokens at the same setting."""
    out = []
    for r in rows:
        k = key(r["unmasking"], r["gen"], r["batch"]) if "unmasking" in r else None
        if r["engine"] == "lmdeploy" and "error" not in r and k in tokens["native"] and k in tokens["lmdeploy"]:
            r = dict(r)
            r["token_agreement"], r["row_agreement"] = agreement(tokens["lmdeploy"][k], tokens["native"][k])
        out.append(r)
    return out


def verdict(rows: list[dict], min_agreement: float, not_run: Optional[str]) -> tuple[dict, list[str]]:
    """({default, reason}, the verdict section's lines), from the finished native/lmdeploy pairs and
    the teacher-forced parity of the grid's weights (the first parity row)."""
    done = {(r["engine"], key(r["unmasking"], r["gen"], r["batch"])): r for r in rows if "error" not in r and "unmasking" in r}
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
                      f"{ratio:.2f}x", "lmdeploy" if ratio > 1 else "native", fmt(m.get("token_agreement"), ".3f")])
    speed = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    over = f"geometric mean of tokens/s over {len(pairs)} setting(s)"
    parity = next((r for r in rows if r.get("kind") == "parity" and "error" not in r), None)
    agree = parity["argmax_agreement_clear"] if parity else None
    if parity is None:
        default, reason = "native", f"lmdeploy is {speed:.2f}x as fast ({over}) but its teacher-forced parity was not measured"
    elif speed > 1 and agree >= min_agreement:
        default, reason = "lmdeploy", (f"lmdeploy is {speed:.2f}x as fast as native ({over}) and its logits agree with DARE's "
                                       f"model teacher-forced: argmax {agree:.2%} of the rows whose top-2 gap is clear of the "
                                       f"error (>= {min_agreement:.0%}; {parity['argmax_agreement']:.2%} of all rows, weights "
                                       f"{parity['weights']})")
    elif speed > 1:
        default, reason = "native", (f"lmdeploy is {speed:.2f}x as fast ({over}) but its teacher-forced argmax agrees with DARE's "
                                     f"model at only {agree:.2%} of the clear rows (< {min_agreement:.0%})")
    else:
        default, reason = "native", f"native is {1 / speed:.2f}x as fast as lmdeploy ({over})"
    lines = markdown_table(["unmasking", "batch", "gen", "native tokens/s", "lmdeploy tokens/s", "lmdeploy / native",
                            "faster", "greedy token agreement"], cells)
    lines += ["", f"Default for SDAR rollouts: **{default}**, because {reason}. Either way, rollouts that record per-step "
              "commits or use our `dynamic` unmasking stay on native: lmdeploy cannot do them (`map_params` refuses)."]
    return {"default": default, "reason": reason}, lines


def parity_lines(rows: list[dict]) -> list[str]:
    cells = []
    for r in (r for r in rows if r.get("kind") == "parity"):
        if "error" in r:
            cells.append([r["weights"]] + [""] * 9 + [r["error"]])
            continue
        firsts = [f for f in r["first_difference"] if f is not None]
        cells.append([r["weights"], r["forwards"], r["rows"], f"{r['max_abs_err']:.3g}", f"{r['max_err_over_std']:.3g}",
                      f"{r['argmax_agreement']:.2%}", f"{r['argmax_agreement_clear']:.2%} of {r['clear_rows']}",
                      f"{r['median_top2_gap']:.3g}", f"{r['greedy_token_agreement']:.3f} / {r['greedy_row_agreement']:.3f}",
                      f"{sorted(firsts)[len(firsts) // 2]} of {r['gen']}" if firsts else "none", ""])
    if not cells:
        return ["(no parity row)"]
    return markdown_table(["weights", "forwards", "logit rows", "max abs error", "max error / logit std", "argmax agreement",
                           "argmax agreement, clear gap", "median top-2 gap", "greedy agreement (tokens / rows)",
                           "median first difference", "note"], cells)


def write_results(args, rows: list[dict], status: str, not_run: Optional[str]) -> None:
    decided, verdict_lines = verdict(rows, MIN_PARITY, not_run)
    cells = []
    for r in (r for r in rows if "unmasking" in r):
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
              f"CUDA graphs {'on' if torch.cuda.is_available() else 'off (CPU)'}. lmdeploy: in its own process (executor uni, "
              f"weights loaded from the folder), cache_max_entry_count {args.cache_max_entry_count}. "
              f"{'Each engine on a GPU of its own, at the same time' if args.side_by_side else 'One engine after the other'}. "
              f"One warm-up, then {args.repeats} timed run(s) per row.",
              "- tokens/s = batch x gen / wall. Agreement: lmdeploy's response tokens against native's at the same setting "
              "(positions equal, rows equal throughout); repeat agreement: the last timed run against the warm-up.",
              f"- Status: {status}.", "", "## Rows", ""]
    lines += markdown_table(["engine", "unmasking", "batch", "gen", "wall s", "denoising steps", "ms / step", "tokens/s",
                             "agreement (tokens)", "agreement (rows)", "repeat agreement", "note"], cells)
    lines += ["", "## Teacher-forced parity", "",
              f"lmdeploy decodes {args.parity_prompts} prompts of up to {args.prompt} random ids, {args.parity_gen} tokens each "
              "(static, greedy), one request at a time with its probe on; DARE's model reads the same tokens at the same "
              "positions (docs/sampling.md#engines). Clear gap: DARE's top-2 logit gap above twice the largest error. Then "
              "both engines decode the same prompts greedily (agreement, and the median position where rows first differ).", ""]
    lines += parity_lines(rows)
    lines += ["", "## Verdict", ""] + verdict_lines
    failed = [r for r in rows if "traceback" in r]
    if failed:
        lines += ["", f"{len(failed)} row(s) failed; their tracebacks are in the JSON beside this file and in the worker logs "
                  f"under {args.workdir}."]
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
    ap.add_argument("--model", type=Path, help="a checkpoint folder for the grid (default: random weights)")
    ap.add_argument("--init-std", nargs="+", type=float, default=[0.3], help="stds of the random weights (grid: the first)")
    ap.add_argument("--parity-model", nargs="*", type=Path, default=[], help="more folders for the parity section (trained)")
    ap.add_argument("--parity-prompts", type=int, default=4)
    ap.add_argument("--parity-gen", type=int, default=32)
    ap.add_argument("--cache-max-entry-count", type=float, default=0.5, help="lmdeploy's KV cache share of free GPU memory")
    ap.add_argument("--side-by-side", action="store_true", help="native on GPU 0 and lmdeploy on GPU 1, at the same time")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rollout_engines"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rollout_engines.md")
    ap.add_argument("--budget", type=float, default=0, help="seconds after which no new row starts (0: no limit)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: two narrow layers, a tiny grid")
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.worker[0], Path(args.worker[1]))
    from train_step_setup import write_model_folder

    if args.tiny:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, whose spin-waits crawl on a shared CPU
    for name, value in (TINY if args.tiny else GRID).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.side_by_side and torch.cuda.device_count() < 2:
        ap.error("--side-by-side needs 2 GPUs")
    deadline = time.time() + args.budget if args.budget else None
    args.libraries = library_versions(("torch", "lmdeploy", "transformers"))
    args.hardware, args.commit, args.command = hardware(), git_commit(), "python3 bench/rollout_engines.py " + shlex.join(sys.argv[1:])
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    folders = []  # (folder, weights) for the grid (first) and every parity
    for std in ([] if args.model else args.init_std):
        folder = args.workdir / "models" / f"sdar{'-tiny' if args.tiny else ''}-std{std:g}"
        if not (folder / "config.json").exists():
            print(f"[rollout_engines] writing random weights to {folder} ...", flush=True)
            write_model_folder("sdar", folder, args.tiny, std=std)
        folders.append((str(folder), f"random, std {std:g}{' (--tiny)' if args.tiny else ''}"))
    if args.model:
        folders.append((str(args.model), f"checkpoint `{args.model}`"))
    folders += [(str(p), f"trained checkpoint `{p.name}`") for p in args.parity_model]
    args.weights = folders[0][1] + " at the SDAR-8B-Chat config" * (not args.model)
    not_run = lmdeploy_missing()
    points = [(g, b) for g in args.gen for b in args.batch]
    parity = {"prompts": args.parity_prompts, "gen": args.parity_gen, "weights": folders[0][1]}
    common = {"threshold": args.threshold, "prompt": args.prompt, "repeats": args.repeats, "deadline": deadline,
              "cache_max_entry_count": args.cache_max_entry_count, "workdir": str(args.workdir)}
    rows_path = args.workdir / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    jobs = [("native", "grid", {**common, "engine": "native", "folder": folders[0][0], "unmasking": args.unmasking,
                                "points": points, "tokens": str(args.workdir / "tokens_native.pt"), "rows": str(rows_path)}, 0)]
    if not_run is None:
        jobs.append(("lmdeploy", "grid", {**common, "engine": "lmdeploy", "folder": folders[0][0], "unmasking": args.unmasking,
                                          "points": points, "tokens": str(args.workdir / "tokens_lmdeploy.pt"),
                                          "rows": str(rows_path), "parity": parity}, 1))
        if folders[1:]:
            jobs.append(("parity", "parity", {**common, "folders": folders[1:], "parity": parity, "rows": str(rows_path)}, 1))
    problems: list[str] = []
    extra = [{"engine": "lmdeploy", "unmasking": u, "gen": g, "batch": b, "error": f"not run: {not_run}"}
             for u in args.unmasking for g, b in points] if not_run else []

    def rows_now() -> list[dict]:
        tokens = {e: torch.load(args.workdir / f"tokens_{e}.pt") if (args.workdir / f"tokens_{e}.pt").exists() else {}
                  for e in ("native", "lmdeploy")}
        return with_agreement(jsonl_rows(rows_path), tokens) + extra

    def run_queue(queue: list) -> None:
        """One GPU's jobs, one after the other."""
        for name, kind, spec, gpu in queue:
            proc, log = start_worker(args, name, kind, spec, gpu if args.side_by_side else None)
            proc.wait()
            if proc.returncode:
                tail = " / ".join(line for line in log.read_text(errors="replace").splitlines()[-3:] if line.strip())[-400:]
                problems.append(f"the {name} worker exited with code {proc.returncode} ({log}): {tail}")

    for name in ("tokens_native.pt", "tokens_lmdeploy.pt"):
        (args.workdir / name).unlink(missing_ok=True)
    queues = [[j for j in jobs if j[3] == gpu] for gpu in (0, 1)] if args.side_by_side else [jobs]
    threads = [threading.Thread(target=run_queue, args=(q,)) for q in queues if q]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        write_results(args, rows_now(), "running", not_run)
        time.sleep(5)
    rows = rows_now()
    cut = any(r.get("error") == "not run: --budget ran out" for r in rows)
    status = (f"stopped by --budget {args.budget:g} s" if cut else "finished") + (f"; {'; '.join(problems)}" if problems else "")
    write_results(args, rows, status, not_run)
    print(f"[rollout_engines] {status}; wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
