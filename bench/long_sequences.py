"""The longest sequence that trains at the 8B shapes: one d1 RL update (forward and backward, LoRA,
gradient checkpointing, packed) on a single sequence of growing length, with the whole logits, with
logits-free scoring, and with Ulysses sequence parallelism.

    python3 bench/long_sequences.py                                   # every mode this machine can run
    python3 bench/long_sequences.py --modes logits logits-free --shapes llada
    python3 bench/long_sequences.py --parallel --budget 540 --modes logits logits-free sp2   # 4 GPUs: side by side
    python3 bench/long_sequences.py --modes sp4 --add       # a later invocation adds its rows to the same file
    python3 bench/long_sequences.py --tiny --out /tmp/ls/long_sequences.md   # CPU smoke run

Modes:
  logits        scores from the whole [tokens, vocab] logits (model.logits_chunk: 0)
  logits-free   scores from the hidden states a chunk of tokens at a time (model.logits_chunk)
  sp2, sp4      logits-free on 2 / 4 GPUs with launch.sequence_parallel 2 / 4: each rank holds
                1/N of the sequence (torchrun, one rank a GPU)

Each (shape, mode) runs in processes of its own, on random weights of the real shape (LLaDA-8B-
Instruct, SDAR-8B-Chat) drawn on the GPU, and climbs the lengths (prompt of 256 tokens, the rest
response) until one does not fit: the longest that fits, its time a step, tokens/s and peak memory
are its row. A length is one sequence of that many tokens (on SDAR the training layout doubles it:
the noisy and the clean stream). The file is rewritten after every mode, so a run stopped by a time
limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from stamp import fmt, git_commit, hardware, header, library_versions, markdown_table, utc_now, write_atomic  # noqa: E402
from train_step_runs import torchrun  # noqa: E402

MODES = {"logits": 1, "logits-free": 1, "sp2": 2, "sp4": 4}  # mode: GPUs
LENGTHS = (2048, 4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072)
TINY_LENGTHS = (64, 128, 256)
PROMPT = 256
LORA = {"r": 128, "alpha": 64}
LOGITS_CHUNK = 4096  # scored tokens a chunk: [4096, 126464] float32 logits are 2 GiB at LLaDA's vocabulary
TARGETS = "at least 16k tokens a sequence at 8B with SP 2, 32k with SP 4; logits-free scoring alone at least doubles the longest length on one GPU at equal or better tokens/s"


@dataclasses.dataclass
class Task:
    shape: str
    mode: str
    lengths: list[int]
    tiny: bool
    reps: int
    out: str


# --------------------------------------------------------------------------- one process of a mode


def _model(task: Task, device: torch.device):
    """The shape's model on `device`, random bf16 weights (float32 on CPU), prepared as the RL stage
    prepares it: LoRA, gradient checkpointing, packing, logits-free scoring per the mode."""
    from dare_core.config import DareConfig, ModelConfig
    from dare_core.models.lm import empty_model
    from dare_core.training.setup import prepare_for_training
    from train_step_setup import shape_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = empty_model(shape_config(task.shape, task.tiny), device=device, dtype=dtype)
    model.net.init_weights(torch.Generator(device).manual_seed(0))
    chunk = 0 if task.mode == "logits" else (LOGITS_CHUNK if not task.tiny else 32)
    cfg = DareConfig(model=ModelConfig(gradient_checkpointing=True, lora=dict(LORA), logits_chunk=chunk))
    return prepare_for_training(model, cfg), cfg


def _batch(model, length: int, device: torch.device, seed: int):
    """One sequence: a prompt of PROMPT tokens and a response of the rest, random ordinary tokens."""
    from dare_core.batch import Batch

    g = torch.Generator().manual_seed(seed)
    vocab = min(model.config.vocab_size, 100 if model.config.vocab_size < 1000 else 30000)
    ids = torch.randint(0, vocab, (1, length), generator=g).to(device)
    prompt = min(PROMPT, length // 4)
    return Batch(ids, torch.ones_like(ids), prompt, torch.ones(1, length - prompt, dtype=torch.bool, device=device), ["s0"],
                 torch.ones(1, device=device))


def _update(model, algo, batch) -> float:
    """One RL update's forward and backward; its seconds."""
    sync = torch.cuda.synchronize if batch.input_ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    corruption = algo.corrupt(batch, (0, 0))
    algo.update(model, batch, corruption, None, None, algo.denominator(batch, corruption), lambda loss: loss.backward())
    sync()
    return time.perf_counter() - t0


def task_main(spec_path: Path) -> int:
    """A process of one (shape, mode): climb the lengths, a result line per length, until one fails."""
    from dare_core.algorithms.registry import build_algorithm
    from dare_core.config import RLConfig

    task = Task(**json.loads(spec_path.read_text()))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, cfg = _model(task, device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a sequence-parallel group of all the ranks, as the stages make it
        from dare_core.training.parallel import init_layout

        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
        model.sequence_shards = init_layout(torch.distributed.get_world_size()).shards
    algo = build_algorithm(RLConfig(algorithm="d1"), model)
    results = []
    for length in task.lengths:
        row = {"length": length}
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            batch = _batch(model, length, device, seed=length)
            _update(model, algo, batch)  # the first step pays kernel selection and allocator growth
            times = [_update(model, algo, batch) for _ in range(task.reps)]
            model.zero_grad(set_to_none=True)
            step = sum(times) / len(times)
            row.update(step_s=step, tokens_per_s=length / step,
                       peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of GPU memory ({str(exc).splitlines()[0][:120]})"
        results.append(row)
        if rank == 0:
            Path(task.out).write_text(json.dumps(results))
        print(f"[long_sequences] {task.shape} {task.mode} {length}: {row.get('error') or fmt(row['step_s']) + ' s'}", flush=True)
        if "error" in row:
            break
        model.zero_grad(set_to_none=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the parent


class ModeRun:
    """One (shape, mode) in processes of its own (torchrun, one rank a GPU) on the GPUs it is given."""

    def __init__(self, workdir: Path, task: Task, gpus: list[int], stop_at: float):
        self.task, self.gpus, self.stop_at = task, gpus, stop_at
        self.code: Optional[int] = None  # the exit code, once finished()
        self.spec = workdir / f"{task.shape}-{task.mode}.json"
        Path(task.out).unlink(missing_ok=True)
        self.spec.write_text(json.dumps(dataclasses.asdict(task)))
        cmd = [*torchrun(len(gpus)), __file__, "--task", str(self.spec)]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        if torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        self.log = self.spec.with_suffix(".log")
        print(f"[long_sequences] {task.shape} {task.mode} on GPU(s) {gpus} ...", flush=True)
        with self.log.open("w") as fh:
            self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def finished(self) -> bool:
        """Whether the run has ended (stopped here once past its time limit); its exit code is then
        `self.code`, None for a run that was stopped."""
        if self.proc.poll() is None:
            if time.monotonic() <= self.stop_at:
                return False
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            self.code = None
        else:
            self.code = self.proc.returncode
        return True

    def rows(self) -> list[dict]:
        code = self.code
        out = Path(self.task.out)
        rows = json.loads(out.read_text()) if out.exists() else []
        if code != 0:
            tail = self.log.read_text().splitlines()[-20:]
            print("\n".join(tail), flush=True)
            why = "stopped at the time limit" if code is None else f"exit code {code}"
            errors = [ln.strip() for ln in tail if ln.strip().startswith(("error:", "RuntimeError", "ValueError", "torch."))]
            rows.append({"length": None, "error": f"{why}: {errors[-1][:300] if errors else 'see the log'}"})
        return rows


def run_modes(workdir: Path, tasks: list[Task], gpus_here: int, parallel: bool, timeout: Optional[float],
              budget: Optional[float], done) -> None:
    """Run every task, each on MODES[mode] GPUs; with `parallel`, as many at once as the GPUs hold
    (disjoint GPUs, in the order given). A task is stopped after `timeout` seconds or when the whole
    `budget` is spent, keeping the lengths it measured; none starts after that. `done(task, rows)` is
    called as each one ends."""
    end = time.monotonic() + (budget or float("inf"))
    pending, running = list(tasks), []
    free = list(range(gpus_here)) if gpus_here else list(range(max(MODES.values())))  # CPU: gloo ranks, any number
    while pending or running:
        for task in list(pending):
            need = MODES[task.mode]
            if time.monotonic() >= end:
                print(f"[long_sequences] {task.shape} {task.mode}: not run, the --budget is spent", flush=True)
                pending.remove(task)
                continue
            if len(free) >= need and (parallel or not running):
                gpus, free[:] = free[:need], free[need:]
                running.append(ModeRun(workdir, task, gpus, min(end, time.monotonic() + (timeout or float("inf")))))
                pending.remove(task)
            if not parallel:
                break
        time.sleep(0.5 if running else 0)
        for run in list(running):
            if run.finished():
                running.remove(run)
                free[:] = sorted(free + run.gpus)
                done(run.task, run.rows())


def summary_row(shape: str, mode: str, gpus: int, rows: list[dict]) -> dict:
    """The longest length that trained, with its step, throughput and memory, and why the next failed."""
    ok = [r for r in rows if "error" not in r]
    best = max(ok, key=lambda r: r["length"]) if ok else None
    failed = next((r for r in rows if "error" in r), None)
    return {"shape": shape, "mode": mode, "gpus": gpus, "longest": best and best["length"], "step_s": best and best["step_s"],
            "tokens_per_s": best and best["tokens_per_s"], "peak_gib": best and best["peak_gib"],
            "next": failed and (f"{failed['length']}: {failed['error']}" if failed["length"] else failed["error"]),
            "lengths": rows}


def kept_rows(path: Path, run: dict, now: set) -> list[dict]:
    """The rows of the earlier runs in `path`, less those measured again now, each naming its commit."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    # rows keep the commit they were measured at (a results file of several runs names each)
    rows = [{"commit": old["run"]["commit"], **r} for r in old["rows"] if (r["shape"], r["mode"]) not in now]
    if any(r["commit"] != run["commit"] for r in rows):
        print(f"[long_sequences] --add: keeping rows measured at an earlier commit, each row names its own", flush=True)
    run["command"] = f"{old['run']['command']}; then {run['command']}"
    run["date"] = old["run"]["date"]
    run["parallel"] = run["parallel"] or old["run"].get("parallel", False)
    return rows


def report(data: dict) -> str:
    run = data["run"]
    lines = header("The longest sequence that trains at the 8B shapes", run["command"], run["hardware"],
                   ", ".join(dict.fromkeys(r.get("commit", run["commit"]) for r in data["rows"])) or run["commit"],
                   run["libraries"], data["written"])
    lines += [f"Runs began: {run['date']}. One d1 update (forward and backward) of one sequence: a prompt of {PROMPT} tokens, "
              f"the rest response; LoRA {json.dumps(LORA)} on every linear layer, gradient checkpointing on, packed "
              f"(varlen attention for LLaDA, FlexAttention for SDAR), bf16, random weights of the real shape; "
              f"logits-free chunks of {LOGITS_CHUNK} tokens. Lengths tried: {', '.join(map(str, run['lengths']))}.", "",
              f"Targets: {TARGETS}.", ""]
    if run.get("parallel"):
        lines += ["Modes ran side by side (`--parallel`), each on GPUs of its own: the GPUs of one host share its CPUs "
                  "and PCIe, not their memory or compute.", ""]
    cols = ["shape", "mode", "GPUs", "longest length that trains", "step (s)", "tokens/s", "peak GiB (rank 0)", "the next length",
            "commit"]
    cells = [[r["shape"], r["mode"], r["gpus"], ("" if r["next"] or not r["longest"] else "at least ") + fmt(r["longest"], ".0f", "none"), fmt(r["step_s"]), fmt(r["tokens_per_s"], ".0f"),
              fmt(r["peak_gib"], ".1f"), r["next"] or "none left to try", r.get("commit", run["commit"])[:7]] for r in data["rows"]]
    lines += ["## Longest sequence per mode", ""] + markdown_table(cols, cells) + [""]
    lines += ["## Every length tried", ""]
    cells = [[r["shape"], r["mode"], fmt(x["length"], ".0f", "-"), fmt(x.get("step_s")), fmt(x.get("tokens_per_s"), ".0f"),
              fmt(x.get("peak_gib"), ".1f"), x.get("error", "")] for r in data["rows"] for x in r["lengths"]]
    lines += markdown_table(["shape", "mode", "length", "step (s)", "tokens/s", "peak GiB", "error"], cells) + [""]
    lines += comparison_lines(data["rows"])
    return "\n".join(lines) + "\n"


def comparison_lines(rows: list[dict]) -> list[str]:
    """Logits-free against whole logits on one GPU: the longest length's ratio, and tokens/s at the
    longest length both modes trained."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        base = next((r for r in rows if r["shape"] == shape and r["mode"] == "logits"), None)
        free = next((r for r in rows if r["shape"] == shape and r["mode"] == "logits-free"), None)
        if not (base and free and base["longest"] and free["longest"]):
            continue
        common = base["longest"]
        speed = {m["mode"]: next((x["tokens_per_s"] for x in m["lengths"] if x["length"] == common and "error" not in x), None)
                 for m in (base, free)}
        ratio = speed["logits-free"] / speed["logits"] if speed["logits-free"] and speed["logits"] else None
        out.append(f"- {shape}: logits-free trains {fmt(free['longest'] / common, '.2f')}x the longest length of whole logits "
                   f"({free['longest']} against {common} tokens); at {common} tokens its tokens/s is "
                   f"{fmt(ratio, '.2f')}x theirs.")
    return (["## Logits-free scoring on one GPU", ""] + out + [""]) if out else []


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=None, help="default: every mode this machine has the GPUs for")
    p.add_argument("--shapes", nargs="+", choices=["llada", "sdar"], default=["llada", "sdar"])
    p.add_argument("--max-length", type=int, default=None, help="climb no further than this length")
    p.add_argument("--reps", type=int, default=2, help="timed steps a length (after one untimed)")
    p.add_argument("--timeout", type=float, default=0, help="seconds one mode may take (0: no limit)")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds the whole invocation may take (0: no limit): modes still running then are stopped, "
                        "keeping the lengths they measured, and modes not yet begun are left out")
    p.add_argument("--workdir", default="/tmp/dare-long-sequences")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "long_sequences.md"))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: two tiny layers, short lengths")
    p.add_argument("--parallel", action="store_true",
                   help="run as many modes at once as the GPUs hold, each on GPUs of its own (e.g. on 4 GPUs: logits, "
                        "logits-free and sp2 together)")
    p.add_argument("--add", action="store_true",
                   help="keep the rows of the JSON already beside --out for the (shape, mode) pairs not run now "
                        "(each row names the commit it was measured at)")
    args = p.parse_args(argv)
    if args.task is not None:
        return task_main(args.task)
    gpus_here = torch.cuda.device_count()
    if not gpus_here and not args.tiny:
        p.error("no GPU here: use --tiny for the CPU smoke run")
    # (--tiny: the SP modes run their ranks on the CPU, gloo)
    modes = args.modes or [m for m, n in MODES.items() if n <= (max(gpus_here, 1) if not args.tiny else 2)]
    short = [m for m in modes if not args.tiny and MODES[m] > gpus_here]
    if short:
        p.error(f"modes {short} need more GPUs than the {gpus_here} here")
    lengths = [n for n in (TINY_LENGTHS if args.tiny else LENGTHS) if not args.max_length or n <= args.max_length]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    command = "python3 bench/long_sequences.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    data = {"run": {"commit": git_commit(), "command": command, "hardware": hardware() + f", {gpus_here} GPU(s)",
                    "libraries": library_versions(), "date": utc_now(), "lengths": lengths,
                    "parallel": args.parallel}, "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tasks = [Task(shape, mode, lengths, args.tiny, args.reps, str(workdir / f"{shape}-{mode}.result.json"))
             for shape in args.shapes for mode in modes]
    earlier = kept_rows(out.with_suffix(".json"), data["run"], {(t.shape, t.mode) for t in tasks}) if args.add else []
    order = {(t.shape, t.mode): i for i, t in enumerate(tasks)}

    def done(task: Task, rows: list[dict]) -> None:
        data["rows"].append({**summary_row(task.shape, task.mode, MODES[task.mode], rows), "commit": data["run"]["commit"]})
        data["rows"].sort(key=lambda r: order[(r["shape"], r["mode"])])
        data["written"] = utc_now()
        whole = {**data, "rows": earlier + data["rows"]}
        write_atomic(out, report(whole))
        write_atomic(out.with_suffix(".json"), json.dumps(whole, indent=1))

    run_modes(workdir, tasks, gpus_here, args.parallel, args.timeout or None, args.budget or None, done)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
