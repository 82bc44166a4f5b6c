"""Training steps of the real stage loops on one GPU, at the LLaDA-8B and SDAR-8B shapes.

    python3 bench/train_step.py                                   # everything (GPU): ~19 min on an H100
    python3 bench/train_step.py --parts sft                       # one part (~5.5 min); --add keeps
    python3 bench/train_step.py --parts rl --add                  #   (~7 min) the rows of earlier runs
    python3 bench/train_step.py --parts rl-d1 --add               #   (~7 min) of this commit and settings
    python3 bench/train_step.py --tiny --workdir /tmp/t --out /tmp/t/train_step.md   # CPU smoke run

Each invocation rewrites --out (default bench/results/train_step.md) and its JSON twin, which holds
the measured rows; with --add the rows of the JSON already there are kept, so parts run by
separate commands (each under a 10-minute limit, say) end up in one file. Measured on an H100 at
LLaDA-8B: writing the folder 20 s, the LoRA SFT pair 2.5 min, the DARE RL run 3.2 min; full-
parameter SFT is skipped with its reason there.

What runs: `run_sft` / `run_rl` themselves (DeepSpeed engine, optimizer, gradient accumulation;
checkpoints and, except where export is timed, the final export off), with phase timing on
(`dare_core.timing`), each in a child process of its own so that every run starts with an
empty GPU, its peak memory is its own, and a run killed for memory is recorded instead of ending
the bench. The config is params.yaml with overrides (`load_config`), as a stage reads it.

The model: for each shape, a checkpoint folder in the real on-disk layout (the real config.json of
bench/configs, the reference index's parameter names, checked, shards up to the size of the
reference's largest), written once per work folder by DARE's own `save_model` from a model built on
the GPU in bf16 and filled with random values there, then loaded by every stage through
`model.path`, as a downloaded checkpoint would be. Its tokenizer covers the model's whole
vocabulary: printable characters (one token each), EOS and MASK at the config's ids, and a
placeholder token for every other id, so token ids match the config and any sampled id decodes.

Parts:
  sft          LoRA SFT (r 32, alpha 16, gradient checkpointing), packed vs padded, and (--compile-shapes)
               packed with `model.compile: true`
  sft-full     full-parameter SFT, ZeRO-3 with the optimizer state on the CPU, packed vs padded
               (not run, with the reason, when the host memory cannot hold the optimizer state)
  rl           one d1 step: 16 prompts x 8 rollouts, gen 256, dual cache (SDAR: block_kv) and CUDA
               graphs, packed training, a synthetic reward keyed on the response tokens; the MFU of
               its training pass (scoring + forward/backward); (--rl-compile-shapes) also with
               `model.compile: true`
  rl-d1        the same step by d1's own code (dllm-reasoning/d1's trainer methods, run unchanged
               by bench/peer_d1.py from a checkout at bench/.peers/d1, its commit recorded) on the
               same folder, prompts, LoRA, rollouts and inner iterations, at d1's own batch
               settings (`public_chunk`: 6 prompts a generate call and a per-device batch); where
               the checkout is absent the row says so
Start-up (stage start to its first step) and the merged LoRA export are measured in the runs; so is
the time from spawning a run's process to the stage's start (interpreter, imports, config), shown
beside it because a user's `dare stage` command pays it too.

The pieces: train_step_setup.py (Settings, the model folders, the data), rl_pieces.py (the synthetic
reward), peer_d1.py (d1's own step), train_step_runs.py (a run in its child process, its results row),
train_step_report.py (the results file). This file is the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from stamp import git_commit, gpu_uuids, library_versions, utc_now, write_atomic  # noqa: E402
from train_step_report import merge_files, merge_previous, report, row_key  # noqa: E402
from train_step_runs import Rows, Runner, run_shape, task_main  # noqa: E402
from train_step_setup import PARTS, SHAPES, Settings  # noqa: E402

# what bench/multi_gpu.py (`import train_step as ts`) and the tests take from here
from model_throughput import peak_bf16  # noqa: E402,F401
from rl_pieces import register_rl_pieces  # noqa: E402,F401
from stamp import hardware, mean  # noqa: E402,F401
from train_step_runs import (RL_PHASES, child_env, metrics_rows, rank_env, torchrun, rl_overrides, sft_overrides,  # noqa: E402,F401
                             sft_step_work, stage_config)
from train_step_setup import write_data, write_model_folder  # noqa: E402,F401


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", type=Path, help=argparse.SUPPRESS)  # a child: run one task
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--public-shapes", nargs="+", choices=list(SHAPES), default=["llada"],
                   help="shapes that also run d1's own step code (d1 is LLaDA's; default: llada)")
    p.add_argument("--compile-shapes", nargs="*", choices=list(SHAPES), default=["llada"],
                   help="shapes whose LoRA SFT also runs packed with model.compile on (default: llada)")
    p.add_argument("--rl-compile-shapes", nargs="*", choices=list(SHAPES), default=[],
                   help="shapes whose DARE RL step also runs with model.compile on (training and scoring passes compiled)")
    p.add_argument("--full-param", choices=("auto", "run"), default="auto",
                   help="auto: skip, saying why, where the host cannot hold the CPU optimizer state")
    p.add_argument("--workdir", default="/tmp/dare-bench", help="model folders, data and runs (kept between runs)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "train_step.md"))
    p.add_argument("--add", action="store_true", help="keep the rows of earlier runs of this commit (their JSON beside --out)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="drop the model folder from the page cache before each run (default: on)")
    p.add_argument("--task-timeout", type=float, default=0, help="seconds one run may take (0: no limit)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the same code paths, two tiny layers")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                   help="change a batch shape or step count (the fields of Settings), e.g. rollout_batch=128")
    p.add_argument("--side-by-side", action="store_true",
                   help="with rl and rl-d1 and 2+ GPUs: run the two at once, DARE's on GPU 0 and d1's own code on GPU 1")
    p.add_argument("--verbose", action="store_true", help="show the runs' output instead of logging it")
    p.add_argument("--replay", type=Path, metavar="TASKS",
                   help="run nothing: build the rows from the task results a finished run wrote to TASKS (its work "
                        "folder's tasks/), e.g. after a fix of how rows are read from them")
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                   help="run nothing: write --out from the rows of these results files (earlier ones first, a later "
                        "row replaces an earlier one of the same measurement), each row credited to its run")
    p.add_argument("--drop-parts", nargs="+", choices=PARTS + ("rl-public",), default=[],
                   help="with --merge: leave out the rows of these parts (e.g. rl-public: the transcription of d1's "
                        "recipe that d1's own code replaced)")
    p.add_argument("--keep-all", action="store_true", help="with --merge: keep every run's rows (each run's ratios and targets "
                   "stay computable) instead of a later row replacing an earlier one of the same measurement")
    args = p.parse_args(argv)
    if args.task is not None:
        return task_main(args.task)
    if args.merge:
        return merge_files(args.merge, Path(args.out), args)
    try:
        s = (Settings.tiny() if args.tiny else Settings()).with_overrides(args.set)
    except ValueError as exc:
        p.error(str(exc))
    workdir = Path(args.workdir)
    # (is_available starts no CUDA context: this process leaves the GPU's memory to the runs)
    if not torch.cuda.is_available() and not args.tiny and not args.replay:
        p.error("no GPU here: use --tiny for the CPU smoke run")
    if args.side_by_side and not args.tiny and not args.replay and torch.cuda.device_count() < 2:
        p.error("--side-by-side needs 2 GPUs")
    runner = Runner(workdir, args.task_timeout, args.verbose, args.replay)
    out = Path(args.out)
    commit = git_commit()
    command = "python3 bench/train_step.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    date = utc_now()
    gpus = gpu_uuids()
    previous = None

    def save(rows: list[dict]) -> str:
        nonlocal previous
        hw = next((r["hardware"] for r in rows if r.get("hardware")), None) or f"(no run finished) {platform.machine()}"
        run = {"commit": commit, "command": command, "hardware": hw, "gpus": gpus, "settings": dataclasses.asdict(s), "date": date,
           "libraries": library_versions() if not args.replay else "(not recorded: rows read back from the task results of --replay)"}
        if previous is None:  # read once: later saves rewrite the file this run is writing
            previous = merge_previous(out.with_suffix(".json"), run, args.add)
        done = {row_key(r) for r in rows}
        # (--add: the rows stay one run's for their ratios; `measured_in` says which invocation made each)
        mine = [{**r, "measured_in": len(previous["runs"])} for r in rows]
        data = {"runs": previous["runs"] + [run], "rows": [r for r in previous["rows"] if row_key(r) not in done] + mine}
        text = report(data, s, args)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, text)
        write_atomic(out.with_suffix(".json"), json.dumps(data, indent=1))
        return text

    rows = Rows(save)
    for shape in args.shapes:
        run_shape(shape, args.parts, args, s, runner, rows)
    print(save(list(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
