"""The stage loops on several GPUs at the 8B shapes, their scaling from 1 GPU, and a multi-node rehearsal.

    python3 bench/multi_gpu.py                                  # everything, on every GPU of the machine
    python3 bench/multi_gpu.py --gpus 1 2 --parts sft-lora rl-lora      # the scaling pairs only
    python3 bench/multi_gpu.py --parts sft-full --add           # keep the rows of earlier runs of this commit
    python3 bench/multi_gpu.py --tiny --gpus 1 2 --workdir /tmp/mg --out /tmp/mg/multi_gpu.md   # CPU smoke run

Each run starts its ranks with torchrun (one process a GPU), and each rank runs the real stage loop
(`run_sft` / `run_rl`, DeepSpeed engine, checkpoints and export off) with phase timing on, on the
model folders and data of bench/train_step.py (random weights in the real on-disk layout of
LLaDA-8B-Instruct and SDAR-8B-Chat, loaded through `model.path`). The global batch is the same on
every number of GPUs (SFT: 8 micro-batches of 16 sequences, fewer accumulation steps a rank; RL: the
step's 16 prompts x 8 rollouts split by whole groups), so a run on N GPUs does the 1-GPU run's work,
and its scaling efficiency is (1-GPU time) / (N x N-GPU time).

Parts:
  sft-lora      LoRA SFT at LLaDA-8B, packed, on each --gpus count (the scaling pair), at each
                --lora-zero stage (ZeRO-0: a whole optimizer a rank; ZeRO-2: 1/N of it a rank)
  sft-full      full-parameter SFT at each shape, ZeRO-3, the optimizer state on the CPU
                (launch.offload_optimizer), packed, on the largest --gpus count
  rl-lora       one d1 step at LLaDA-8B, LoRA, dual cache and CUDA graphs, on each --gpus count
  rl-full       the same step, full-parameter, ZeRO-3 with the optimizer on the CPU, on each count
  rl-threshold  the LoRA step under ZeRO-3 with threshold unmasking (each rank decodes on the whole
                weights, gathered once a step: launch.rollout_weights)
  multinode     the embedded tiny model: SFT and RL as one node of N ranks, and as 2 "nodes" of N/2
                GPUs each (N of one GPU when N < 4) started as the README tells (torchrun
                nnodes/node_rank, master 127.0.0.1)
The file is rewritten after every run, so a run stopped by a time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
import train_step as ts  # noqa: E402
from stamp import fmt as stamp_fmt, git_commit, library_versions, markdown_table, utc_now  # noqa: E402

PARTS = ("sft-lora", "sft-full", "rl-lora", "rl-full", "rl-threshold", "multinode")
OFFLOAD = {"launch.zero_stage": 3, "launch.offload_optimizer": "cpu"}
# this bench's own batch (over train_step's Settings): a global SFT batch of 128 sequences, so that
# 4 GPUs still run 2 micro-batches of 16 a rank, as a user scaling out keeps the micro-batch
DEFAULTS = {"sft_accum": 8}
# what a multi-rank run used to end with on success, and NCCL's watchdog on a timeout: counted in each
# run's log (the stage's own stderr), where a user would read them as a crash
CPP_NOISE = ("TCPStore", "destroy_process_group", "Guessing device ID", "frame #", "Exception raised from", "terminate called")


# --------------------------------------------------------------------------- one rank


def rank_main(spec_path: Path) -> int:
    """A rank of one run (started by torchrun): the stage loop, then this rank's result file."""
    spec = json.loads(spec_path.read_text())
    if spec.get("stacks_after"):  # a run about to hit its time limit leaves where its ranks were in the log
        faulthandler.dump_traceback_later(spec["stacks_after"], file=sys.stderr)
    s = ts.Settings(**spec["settings"])
    rank = int(os.environ.get("RANK", "0"))
    if spec["kind"] == "sft":
        from dare_core.training.sft_loop import run_sft

        cfg = ts.stage_config({**spec, "overrides": {**ts.sft_overrides(spec, s), **spec["extra"]}})
        summary = run_sft(cfg, progress=False, save_checkpoints=False, export=False, phase_times=True)
    else:
        from dare_core.models.hf_folder import inspect_model
        from dare_core.training.rl.loop import run_rl

        ts.register_rl_pieces()
        block = inspect_model(spec["folder"]).block_size
        rl = ts.rl_overrides(spec, s, block)
        rl["rl.sampler"] = {**rl["rl.sampler"], **spec["extra"].pop("rl.sampler", {})}
        cfg = ts.stage_config({**spec, "overrides": {**rl, **spec["extra"]}})
        summary = run_rl(cfg, progress=False, save_checkpoints=False, phase_times=True)
    out = {"summary": summary, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    if rank == 0:
        out.update(metrics=ts.metrics_rows(cfg.stage_dir(spec["kind"])), hardware=ts.hardware(), peak_flops=ts.peak_bf16())
        if spec["kind"] == "sft":
            out["work"] = ts.sft_step_work(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
    spec_path.with_suffix(f".rank{rank}.json").write_text(json.dumps(out))
    from dare_core.process.process_group import shutdown_distributed

    shutdown_distributed(clean=True)  # as `dare stage` ends a rank (workers/common.py run_worker)
    return 0


# --------------------------------------------------------------------------- the parent


def split_batch(s: ts.Settings, gpus: int) -> dict:
    """SFT micro-batch and accumulation per rank that keep the 1-GPU global batch on `gpus` GPUs."""
    per_rank = s.sft_micro * s.sft_accum // gpus
    micro = min(s.sft_micro, per_rank)
    return {"sft.micro_batch_size": micro, "sft.grad_accum": per_rank // micro}


def launch(runner_dir: Path, name: str, spec: dict, gpus: int, timeout: Optional[float], verbose: bool) -> dict:
    """Run one measurement on `gpus` ranks; its rank-0 result with the ranks' peak memory, or an error."""
    spec_path = runner_dir / f"{name}.json"
    for old in runner_dir.glob(f"{name}.rank*.json"):
        old.unlink()
    spec_path.write_text(json.dumps({**spec, "stacks_after": timeout - 20 if timeout and timeout > 60 else None}))
    log_path = spec_path.with_suffix(".log")
    cmd = [*ts.torchrun(gpus), __file__, "--task", str(spec_path)]
    print(f"[multi_gpu] {name} on {gpus} GPU(s) ...", flush=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        try:
            code = subprocess.run(cmd, env=ts.rank_env(gpus), cwd=REPO, stdout=None if verbose else log, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    wall = time.perf_counter() - t0
    parts = [json.loads(p.read_text()) for p in sorted(runner_dir.glob(f"{name}.rank*.json"))]
    if code != 0 or len(parts) != gpus:
        tail = log_path.read_text().splitlines()[-30:]
        print("\n".join(tail), flush=True)
        why = "stopped at the time limit" if code is None else f"exit code {code}"
        errors = [line.strip() for line in tail if line.strip().startswith(("error:", "torch.OutOfMemoryError", "RuntimeError"))]
        return {"error": f"{why}: {errors[-1][:300] if errors else 'see the log'}", "wall_s": wall}
    result = parts[0]
    noise = sum(1 for line in log_path.read_text().splitlines() if any(m in line for m in CPP_NOISE))
    result.update(wall_s=wall, peak_gib=max(p["peak_gib"] or 0 for p in parts), noise_lines=noise)
    print(f"[multi_gpu] {name}: ok ({wall:.0f} s)", flush=True)
    return result


def sft_row(name: str, shape: str, training: str, gpus: int, extra: dict, result: dict, s: ts.Settings) -> dict:
    row = {"part": f"sft-{training}", "name": name, "shape": shape, "training": training, "gpus": gpus,
           "zero": extra.get("launch.zero_stage", 0), "offload": extra.get("launch.offload_optimizer", "none")}
    if "error" in result:
        return {**row, "error": result["error"]}
    steps = [m for m in result["metrics"] if "time/step_s" in m]
    timed, work = steps[s.sft_warmup:], result["work"][s.sft_warmup:]
    seconds = sum(m["time/step_s"] for m in timed)
    tokens = sum(w["real_tokens"] for w in work)
    peak = result.get("peak_flops")
    row.update(step_s=seconds / len(timed), tokens_per_s=tokens / seconds, tokens_per_s_gpu=tokens / seconds / gpus,
               mfu=sum(w["flops"] for w in work) / seconds / (peak * gpus) if peak else None,
               fwd_bwd_s=ts.mean([m.get("time/forward_backward_s") for m in timed]),
               optimizer_s=ts.mean([m.get("time/optimizer_s") for m in timed]),
               rank_balance=ts.mean([max(w["rank_tokens"]) * gpus / sum(w["rank_tokens"]) for w in work]),
               peak_gib=result["peak_gib"], losses=[m.get("loss") for m in steps], wall_s=result["wall_s"],
               noise_lines=result["noise_lines"])
    return row


def rl_row(name: str, training: str, gpus: int, extra: dict, result: dict) -> dict:
    sampler = extra.get("rl.sampler", {})
    row = {"part": f"rl-{training}", "name": name, "training": training, "gpus": gpus, "zero": extra.get("launch.zero_stage", 0),
           "offload": extra.get("launch.offload_optimizer", "none"), "unmasking": sampler.get("unmasking", "topk")}
    if "error" in result:
        return {**row, "error": result["error"]}
    steps = [m for m in result["metrics"] if "time/step_s" in m]
    last = steps[-1]
    row.update({p: last.get(f"time/{p}_s", 0.0) for p in ts.RL_PHASES})
    row.update(step_s=last["time/step_s"], peak_gib=result["peak_gib"], rewards=[m.get("reward") for m in steps],
               rollout_steps=last.get("rollout_steps"), wall_s=result["wall_s"], noise_lines=result["noise_lines"])
    row["other"] = row["step_s"] - sum(row[p] for p in ts.RL_PHASES)
    return row


def measure(parts: list[str], gpu_counts: list[int], shapes: list[str], s: ts.Settings, workdir: Path, args, rows: list) -> None:
    runner_dir = workdir / "tasks"
    runner_dir.mkdir(parents=True, exist_ok=True)
    data = workdir / f"data-{s.sft_micro * s.sft_accum * (s.sft_warmup + s.sft_steps)}"  # rows the SFT runs read
    if not (data / "rl.parquet").exists():
        data.mkdir(parents=True, exist_ok=True)
        ts.write_data(data, s)
    needed = ["llada"] + [sh for sh in shapes if "sft-full" in parts and sh != "llada"]
    folders = {}
    for shape in needed:
        folders[shape] = workdir / shape / "model"
        if not (folders[shape] / "config.json").exists():
            ts.write_model_folder(shape, folders[shape], args.tiny)
    top = max(gpu_counts)

    def spec(name: str, kind: str, shape: str, training: str, extra: dict) -> dict:
        run_name = f"mg-{name}"
        shutil.rmtree(workdir / "runs" / run_name, ignore_errors=True)
        if kind == "rl":  # RL starts from the SFT stage's export: here, the shape's folder itself
            start = workdir / "runs" / run_name / "sft" / "model"
            start.parent.mkdir(parents=True)
            start.symlink_to(folders[shape], target_is_directory=True)
        return {"kind": kind, "shape": shape, "training": training, "recipe": "dare", "name": run_name, "workdir": str(workdir),
                "data": str(data), "folder": str(folders[shape]), "settings": dataclasses.asdict(s), "extra": extra,
                "packing": "on", "spawned_at": time.time()}

    def run(name: str, gpus: int, sp: dict) -> dict:
        return launch(runner_dir, name, sp, gpus, args.task_timeout or None, args.verbose)

    if "sft-lora" in parts:
        for zero in args.lora_zero:
            for g in gpu_counts:
                extra = {**split_batch(s, g), **({"launch.zero_stage": zero} if zero else {})}
                name = f"sft-lora{f'-z{zero}' if zero else ''}-llada-{g}gpu"
                rows.append(sft_row(name, "llada", "lora", g, extra, run(name, g, spec(name, "sft", "llada", "lora", extra)), s))
    if "sft-full" in parts:
        for shape in shapes:
            extra = {**split_batch(s, top), **OFFLOAD}
            name = f"sft-full-{shape}-{top}gpu"
            rows.append(sft_row(name, shape, "full", top, extra, run(name, top, spec(name, "sft", shape, "full", extra)), s))
    # under ZeRO-3 the rollouts decode on the whole weights (launch.rollout_weights), with CUDA graphs
    # as at ZeRO-0; full-parameter rollouts go 64 at a time (the reference model's copy takes the room)
    rl_variants = {"rl-lora": ("lora", {}, gpu_counts),
                   "rl-full": ("full", {**OFFLOAD, "model.lora": None, "rl.sampler": {"batch_size": s.rollout_batch // 2}}, gpu_counts),
                   "rl-threshold": ("lora", {"launch.zero_stage": 3, "rl.sampler": {"unmasking": "threshold", "threshold": 0.9}}, [top])}
    for part, (training, extra, counts) in rl_variants.items():
        if part not in parts:
            continue
        for g in counts:
            name = f"{part}-llada-{g}gpu"
            sp = spec(name, "rl", "llada", training, json.loads(json.dumps(extra)))
            rows.append(rl_row(name, part.removeprefix("rl-"), g, extra, run(name, g, sp)))
    if "multinode" in parts:
        from multinode import rehearse

        rows.extend(rehearse(workdir / "multinode", top, args.task_timeout or None))


# --------------------------------------------------------------------------- the report


fmt = partial(stamp_fmt, missing="–")  # a cell not measured


def efficiency(one: Optional[float], many: Optional[float], gpus: int) -> Optional[float]:
    """Per-GPU scaling efficiency of a fixed amount of work: 1-GPU time / (N x N-GPU time)."""
    return one / (gpus * many) if one and many else None


def _values(key: str, spec: str = ".4f"):
    return lambda r: ", ".join(fmt(x, spec) for x in r[key])


# a column: its header, its cell; the first IDENT columns say what ran, also for a run that failed
IDENT = 4
SETUP = [("run", lambda r: r["name"]), ("GPUs", lambda r: str(r["gpus"])), ("ZeRO", lambda r: str(r["zero"])),
         ("optimizer on", lambda r: r["offload"])]
SFT_COLUMNS = SETUP + [
    ("step (s)", lambda r: fmt(r["step_s"])), ("tokens/s", lambda r: fmt(r["tokens_per_s"], ".0f")),
    ("tokens/s per GPU", lambda r: fmt(r["tokens_per_s_gpu"], ".0f")), ("MFU", lambda r: fmt(r["mfu"] and 100 * r["mfu"], ".1f") + "%"),
    ("busiest rank's tokens / mean", lambda r: fmt(r.get("rank_balance"), ".3f")),
    ("fwd+bwd (s)", lambda r: fmt(r["fwd_bwd_s"])), ("optimizer (s)", lambda r: fmt(r["optimizer_s"])),
    ("peak GiB (max over ranks)", lambda r: fmt(r["peak_gib"], ".1f")), ("losses", _values("losses")),
    ("C++ trace lines", lambda r: str(r["noise_lines"]))]
RL_COLUMNS = SETUP + [("unmasking", lambda r: r["unmasking"]), ("denoising steps", lambda r: fmt(r.get("rollout_steps"), ".0f")),
                      ("step (s)", lambda r: fmt(r["step_s"]))] + [
    (p.replace("forward_backward", "fwd+bwd"), (lambda p: lambda r: fmt(r[p]))(p)) for p in (*ts.RL_PHASES, "other")] + [
    ("peak GiB", lambda r: fmt(r["peak_gib"], ".1f")), ("rewards per step", _values("rewards")),
    ("C++ trace lines", lambda r: str(r["noise_lines"]))]


def table(title: str, columns: list, rows: list[dict]) -> list[str]:
    """A markdown table, a row per run; a run that failed shows what ran and its error."""
    cells = [[cell(r) for _, cell in columns[:IDENT]] + [f"not run: {r['error']}"] + [""] * (len(columns) - IDENT - 1)
             if "error" in r else [cell(r) for _, cell in columns] for r in rows]
    return [title, ""] + markdown_table([h for h, _ in columns], cells) + [""]


def report(data: dict, s: ts.Settings) -> str:
    from stamp import header

    run = data["runs"][-1]
    rows = data["rows"]
    # a --render keeps what the measuring machine had and when it wrote the rows
    lines = header("The stage loops on several GPUs at the 8B shapes", run["command"], run["hardware"], run["commit"],
                   run.get("libraries"), data.get("written"))
    lines += [f"Runs began: {run['date']}. Settings (bench/train_step.py's Settings): `{json.dumps(run['settings'])}`", ""]
    if data.get("rendered_by") and data["rendered_by"] != run["commit"]:
        lines += [f"Laid out by commit {data['rendered_by']} (`--render`) from the measurements of the commit above.", ""]
    earlier = [r for r in data["runs"][:-1]]
    if earlier:
        lines += ["Rows of earlier invocations at this commit are kept (--add): " + "; ".join(f"`{r['command']}` ({r['date']})" for r in earlier), ""]
    sft = [r for r in rows if r["part"].startswith("sft")]
    if sft:
        lines += table("## SFT (packed; the same global batch on every GPU count)", SFT_COLUMNS, sft)
    rl = [r for r in rows if r["part"].startswith("rl")]
    if rl:
        lines += table("## One d1 RL step at LLaDA-8B (16 prompts x 8 rollouts, split by whole groups across the ranks)",
                       RL_COLUMNS, rl)
    lines += scaling_lines(rows)
    lines += multinode_lines(rows)
    return "\n".join(lines) + "\n"


def scaling_lines(rows: list[dict]) -> list[str]:
    """Per-GPU efficiency from 1 GPU to each larger count, and for RL where a shortfall comes from."""
    ok = [r for r in rows if "error" not in r and "step_s" in r]
    cells = []
    shortfalls = []
    setups = sorted({(r["part"], r["zero"]) for r in ok if r["part"] in ("sft-lora", "rl-lora", "rl-full")},
                    key=lambda ps: (("sft-lora", "rl-lora", "rl-full").index(ps[0]), ps[1]))
    for part, zero in setups:
        same = [r for r in ok if r["part"] == part and r["zero"] == zero]
        base = next((r for r in same if r["gpus"] == 1), None)
        for r in (r for r in same if r["gpus"] > 1 and base):
            eff = efficiency(base["step_s"], r["step_s"], r["gpus"])
            phases = (*ts.RL_PHASES, "other") if part.startswith("rl") else ("fwd_bwd_s", "optimizer_s")
            lost = sorted(((r["gpus"] * (r.get(p) or 0) - (base.get(p) or 0), p) for p in phases), reverse=True)
            where = ", ".join(f"{p}: {fmt(base.get(p))} / {fmt(r['gpus'] * (r.get(p) or 0))}" for _, p in lost[:3])
            verdict = "meets it" if eff and eff >= 0.9 else "short"
            cells.append([part, zero, r["gpus"], fmt(base["step_s"]), fmt(r["step_s"]), fmt(eff and 100 * eff, ".1f") + "%", verdict, where])
            if verdict == "short":
                shortfalls.append((f"{part} (ZeRO-{zero})", r, [p for extra, p in lost[:2] if extra > 0]))
    if not cells:
        return []
    columns = ["part", "ZeRO", "GPUs", "1-GPU step (s)", "N-GPU step (s)", "efficiency per GPU", "verdict",
               "where it is lost (phase: 1-GPU s / N x N-GPU s)"]
    out = ["## Scaling from 1 GPU (target: at least 90 % per GPU)", ""] + markdown_table(columns, cells)
    if shortfalls:
        out += ["", "Why a part falls short: what its losing phases do on several GPUs of one host that one GPU does not.", ""]
        out += [f"- {part} on {r['gpus']} GPUs, {p}: {why_lost(p, r)}" for part, r, phases in shortfalls for p in phases]
    return out + [""]


def why_lost(phase: str, row: dict) -> str:
    """The mechanism that makes `phase` cost more GPU-seconds on several GPUs, from the run's settings."""
    zero3, offload = row["zero"] >= 3, row["offload"] != "none"
    if phase in ("optimizer", "optimizer_s"):
        if offload:
            return ("the optimizer steps on the host's CPUs (launch.offload_optimizer: cpu); the ranks of one host share its "
                    "cores and memory bandwidth (each rank gets 1/N of the threads), so the CPU side does not grow with the GPUs "
                    "as it would with more nodes")
        if row["zero"] == 0:
            return ("every rank steps all the trainable weights (ZeRO-0 keeps a whole optimizer per rank), a fixed cost per "
                    "step that more GPUs do not divide")
        return ("each rank steps its 1/N of the trainable weights, then the updated weights are all-gathered; the "
                "gather and the step's fixed launch costs do not divide")
    if phase in ("forward_backward", "fwd_bwd_s"):
        if zero3:
            return ("under ZeRO-3 each layer's weights are gathered from the other ranks before its forward and backward, "
                    "and the gradients are reduce-scattered; one GPU holds everything and does neither")
        how = ("all-reduced across the ranks at the end of each step (DeepSpeed runs it after the last backward at "
               "ZeRO-0, not overlapped with it)") if row["zero"] == 0 else "reduce-scattered across the ranks in the last backward"
        return (f"the gradients are {how}, and every rank waits there for the slowest one (equal tokens, but not equal "
                "attention work: a rank's cost grows with its sequences' squared lengths); each rank also runs fewer "
                "micro-batches, over which its fixed per-step costs spread")
    if phase == "rollout":
        if zero3:
            return ("under ZeRO-3 the rollout begins by gathering the whole weights on every rank and ends by partitioning "
                    "them again (launch.rollout_weights: whole); one GPU has nothing to gather")
        return "each rank decodes its own groups; the step waits for the rank whose rows take longest"
    return "waits for the slowest rank, and the step's metrics reduced across the ranks"


def multinode_lines(rows: list[dict]) -> list[str]:
    mn = [r for r in rows if r["part"] == "multinode"]
    if not mn:
        return []
    # (RL logs reward, then loss, at each step)
    cells = [[r["stage"], r["layout"], f"not run: {r['error']}", "", ""] if "error" in r else
             [r["stage"], r["layout"], fmt(r["wall_s"], ".1f"), f"{r.get('logged', '')}: {', '.join(fmt(v, '.5f') for v in r['values'])}",
              r.get("equal", "(reference)")] for r in mn]
    columns = ["stage", "layout", "wall (s)", "logged values per step", "equal to one node"]
    return ["## Several nodes, rehearsed on one host (the embedded tiny model)", ""] + markdown_table(columns, cells) + [""]


def render(out: Path) -> int:
    """The report of measured rows, laid out by this commit's code: the measurements keep their commit,
    and the file says which commit laid them out."""
    data = json.loads(out.with_suffix(".json").read_text())
    data["rendered_by"] = git_commit()
    if "written" not in data and out.exists():  # a file from before the JSON kept the time: its own Date line
        data["written"] = next((line.removeprefix("Date: ") for line in out.read_text().splitlines() if line.startswith("Date: ")), None)
    ts.write_atomic(out, report(data, ts.Settings(**data["runs"][-1]["settings"])))
    ts.write_atomic(out.with_suffix(".json"), json.dumps(data, indent=1))
    print(out.read_text())
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", type=Path, help=argparse.SUPPRESS)  # a rank of one run
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--gpus", nargs="+", type=int, default=None, help="GPU counts to run on (default: 1 and all of them)")
    p.add_argument("--lora-zero", nargs="+", type=int, choices=[0, 1, 2], default=[0, 2], help="ZeRO stages of sft-lora")
    p.add_argument("--shapes", nargs="+", choices=list(ts.SHAPES), default=list(ts.SHAPES), help="shapes of sft-full")
    p.add_argument("--workdir", default="/tmp/dare-multi-gpu", help="model folders, data and runs (kept between runs)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "multi_gpu.md"))
    p.add_argument("--add", action="store_true", help="keep the rows of earlier runs of this commit (the JSON beside --out)")
    p.add_argument("--render", action="store_true", help="no run: write --out again from the JSON beside it (a new report layout)")
    p.add_argument("--task-timeout", type=float, default=0, help="seconds one run may take (0: no limit)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the same code paths, two tiny layers")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE", help="change a batch shape or step count (train_step's Settings)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.task is not None:
        return rank_main(args.task)
    s = (ts.Settings.tiny() if args.tiny else dataclasses.replace(ts.Settings(), **DEFAULTS)).with_overrides(args.set)
    if args.render:
        return render(Path(args.out))
    available = torch.cuda.device_count()
    if not available and not args.tiny:
        p.error("no GPU here: use --tiny for the CPU smoke run")
    gpu_counts = sorted(set(args.gpus or [1, max(available, 1)]))
    out = Path(args.out)
    commit = git_commit()
    command = "python3 bench/multi_gpu.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    run = {"commit": commit, "command": command, "hardware": ts.hardware() + f", {available} GPU(s)",
           "settings": dataclasses.asdict(s), "date": utc_now(),
           "libraries": library_versions()}
    previous = {"runs": [], "rows": []}
    if args.add and out.with_suffix(".json").exists():
        old = json.loads(out.with_suffix(".json").read_text())
        if old["runs"] and old["runs"][-1]["commit"] == commit:
            previous = old

    class Rows(list):
        def append(self, row: dict) -> None:
            super().append(row)
            names = {r["name"] for r in self}
            data = {"runs": previous["runs"] + [run], "rows": [r for r in previous["rows"] if r["name"] not in names] + list(self),
                    "written": utc_now()}
            out.parent.mkdir(parents=True, exist_ok=True)
            ts.write_atomic(out, report(data, s))
            ts.write_atomic(out.with_suffix(".json"), json.dumps(data, indent=1))

        def extend(self, rows) -> None:
            for row in rows:
                self.append(row)

    rows = Rows()
    measure(args.parts, gpu_counts, args.shapes, s, Path(args.workdir), args, rows)
    if out.exists():
        print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
