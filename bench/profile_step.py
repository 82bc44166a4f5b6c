"""Profile of one RL step's parts on one GPU, at the LLaDA-8B and SDAR-8B shapes: torch.profiler's
kernels of one rollout denoising step at 128 rollouts, one scoring micro-batch and one training
micro-batch, summed up as the top kernels by GPU time and the share of the wall time in GEMMs,
attention, sampling, copies, other kernels and launch gaps.

    python3 bench/profile_step.py                                   # both shapes, all three parts (GPU)
    python3 bench/profile_step.py --shapes sdar --add               # one shape; --add keeps the other's rows
    python3 bench/profile_step.py --compare bench/results/profile_step_before.json   # beside an earlier run
    python3 bench/profile_step.py --tiny --workdir /tmp/p --out /tmp/p/profile_step.md   # CPU smoke run

What runs is the RL stage of bench/train_step.py's `rl` part, on the same model folders (the real
config, random weights; written once per work folder, shared with train_step.py) and settings
(`--set` changes them as there), one child process per shape; bench/profile_phases.py says how
each part is cut out of the step. Each invocation rewrites --out (default
bench/results/profile_step.md) and its JSON twin, which holds every row whole: per part, the
kernel table per name (launches, GPU microseconds) of each profiled run and of the unit derived
from them, its wall and busy times, and the summary; --add keeps the rows of the JSON already there
(same commit, machine and settings), --compare puts each part beside the same part of an earlier
run's JSON. The traces (Chrome/Perfetto) go to --traces.

The pieces: profile_summary.py (kernel kinds, the trace's kernels, the arithmetic), profile_phases.py
(the child's stage), profile_report.py (the results file). This file is the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from profile_report import report  # noqa: E402
from stamp import git_commit, library_versions, utc_now, write_atomic  # noqa: E402
from train_step_report import merge_previous  # noqa: E402
from train_step_runs import Runner, prepare_shape, rl_stage_config, run_rl_on_folder, run_task, task_main  # noqa: E402
from train_step_setup import SHAPES, Settings  # noqa: E402

PHASES = ("denoise", "scoring", "training")  # what profile_phases.ProfileStage profiles


def profile_task(spec: dict) -> dict:
    """A child's task: "profile" here; the others (the model folder) are train_step.py's."""
    if spec["kind"] != "profile":
        return run_task(spec)
    from profile_phases import ProfileStage

    cfg = rl_stage_config(spec, Settings(**spec["settings"]))
    return run_rl_on_folder(cfg, spec["folder"], functools.partial(ProfileStage, options=spec["profile"]))


def shape_rows(shape: str, args, s: Settings, runner: Runner) -> list[dict]:
    """The rows of one shape's parts (each part's error where its run failed)."""
    spec, written = prepare_shape(shape, Path(args.workdir), args.tiny, s, runner)
    result = written if written is not None and "error" in written else None
    if result is None:
        options = {"phases": args.phases, "warmup": args.warmup, "repeats": args.repeats, "top": args.top,
                   "traces": str(Path(args.traces or Path(args.workdir) / "traces").resolve() / shape)}
        result = runner(f"{shape}-profile", {**spec, "name": "profile", "kind": "profile", "profile": options})
    if "error" in result:
        return [{"shape": shape, "phase": phase, "error": result["error"]} for phase in args.phases]
    # task_s: the child's whole run (start-up, the warm-up rollout, every part), what a run of it costs
    return [{"shape": shape, "hardware": result["hardware"], "peak_gib": result.get("max_memory_gib"), "task_s": result["wall_s"],
             **row} for row in result["rows"]]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", type=Path, help=argparse.SUPPRESS)  # a child: run one task
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--workdir", default="/tmp/dare-bench", help="model folders, data and runs (kept between runs; "
                   "train_step.py's default too, so their folders are shared)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "profile_step.md"))
    p.add_argument("--traces", help="folder for the profiler's traces (default: WORKDIR/traces)")
    p.add_argument("--add", action="store_true", help="keep the rows of earlier runs of this commit (their JSON beside --out)")
    p.add_argument("--compare", type=Path, metavar="JSON", help="an earlier run's JSON: each part beside its own")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each part first (after the rollout's warm-up)")
    p.add_argument("--repeats", type=int, default=3, help="unprofiled runs whose median is the wall time")
    p.add_argument("--top", type=int, default=15, help="kernels listed per part")
    p.add_argument("--task-timeout", type=float, default=0, help="seconds one shape's run may take (0: no limit)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the same code paths, two tiny layers")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                   help="change a batch shape or step count (the fields of train_step_setup.Settings), e.g. rollout_batch=64")
    p.add_argument("--verbose", action="store_true", help="show the runs' output instead of logging it")
    args = p.parse_args(argv)
    if args.task is not None:
        return task_main(args.task, profile_task)
    try:
        s = (Settings.tiny() if args.tiny else Settings()).with_overrides(args.set)
    except ValueError as exc:
        p.error(str(exc))
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    # (is_available starts no CUDA context: this process leaves the GPU's memory to the runs)
    if not torch.cuda.is_available() and not args.tiny:
        p.error("no GPU here: use --tiny for the CPU smoke run")
    compare = (args.compare, json.loads(args.compare.read_text())) if args.compare else None
    runner = Runner(Path(args.workdir), args.task_timeout, args.verbose, entry=Path(__file__).resolve())
    out = Path(args.out)
    given = argv if argv is not None else sys.argv[1:]
    run = {"commit": git_commit(), "date": utc_now(), "settings": dataclasses.asdict(s), "libraries": library_versions(),
           "command": "python3 bench/profile_step.py " + " ".join(shlex.quote(a) for a in given)}
    rows: list[dict] = []
    previous = None
    for shape in args.shapes:
        rows += shape_rows(shape, args, s, runner)
        run["hardware"] = next((r["hardware"] for r in rows if r.get("hardware")), None) or f"(no run finished) {platform.machine()}"
        if previous is None:  # read once: later saves rewrite the file this run is writing
            previous = merge_previous(out.with_suffix(".json"), run, args.add)
        done = {(r["shape"], r["phase"]) for r in rows}
        data = {"runs": previous["runs"] + [run], "rows": [r for r in previous["rows"] if (r["shape"], r["phase"]) not in done] + rows}
        text = report(data, s, args.tiny, compare)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, text)  # after each shape: a run stopped by a time limit keeps the shapes it finished
        write_atomic(out.with_suffix(".json"), json.dumps(data, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
