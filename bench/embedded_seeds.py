"""Run-to-run noise of the embedded default: the whole pipeline for several run seeds.

    .venv/bin/python bench/embedded_seeds.py --seeds 0 1 2

Each seed runs prepare, sft, rl, convert and eval through `dare stage` (the same workers DVC runs)
under its own run name, then the held-out accuracies of base, SFT and RL are tabulated with their
mean and standard deviation in bench/results/embedded_seeds.md, with the machine they ran on.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from stamp import REPO, git_commit, hardware, header, markdown_table
STAGES = ["prepare", "sft", "rl", "convert", "eval"]


def run_seed(seed: int, params: str, extra: list[str], prefix: str = "seed") -> dict:
    name = f"{prefix}{seed}"
    sets = [*extra, f"run.seed={seed}", f"run.name={name}", f"run.metrics_dir=runs/{name}/metrics"]
    timings = {}
    for stage in STAGES:
        t0 = time.time()
        cmd = [sys.executable, "-m", "dare_core.cli", "stage", stage, "--params", params] + [f"--set={s}" for s in sets]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        timings[stage] = round(time.time() - t0, 1)
    metrics = json.loads((REPO / "runs" / name / "metrics" / "eval.json").read_text())
    return {"seed": seed, "timings": timings, **{k: metrics[k]["arithmetic"] / 100 for k in ("base", "sft", "rl")}}


def table(rows: list[dict]) -> str:
    cells = [[r["seed"], f"{r['base']:.3f}", f"{r['sft']:.3f}", f"{r['rl']:.3f}", " / ".join(str(r["timings"][s]) for s in STAGES)]
             for r in rows]
    if len(rows) > 1:
        stats = {k: (statistics.mean(r[k] for r in rows), statistics.stdev(r[k] for r in rows)) for k in ("base", "sft", "rl")}
        cells.append(["mean ± std"] + [f"{m:.3f} ± {s:.3f}" for m, s in stats.values()] + [""])
    return "\n".join(markdown_table(["run seed", "base", "SFT", "RL", "wall time (s): prepare / sft / rl / convert / eval"], cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "embedded_seeds.md"))
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting over the params file for every stage, e.g. recipe=configs/embedded_diffusion_gemma.yaml")
    p.add_argument("--title", default="Embedded default: held-out accuracy over run seeds")
    args = p.parse_args()
    commit = git_commit()  # (as the runs begin: a commit made while they run did not make them)
    rows = []
    # (runs of other settings get their own run names: a stage must not resume another's outputs)
    prefix = "seed" if not args.sets else f"{Path(args.out).stem}-seed"
    for seed in args.seeds:
        rows.append(run_seed(seed, args.params, args.sets, prefix))
        print(table(rows), flush=True)
    command = "python3 bench/embedded_seeds.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    over = f", with {' '.join(args.sets)}" if args.sets else ""
    text = "\n".join(header(args.title, command, hardware(gpu=False, cpu_detail=True), commit=commit)) + (
        f"\nConfig: {args.params}{over} at that commit (data seed fixed, so every run sees the same held-out problems; the run "
        "seed changes model init, data order, masks and rollouts). Accuracy: the eval stage's OpenCompass score of the "
        "task benchmark (exact answer), divided by 100, with the eval sampler of the params file.\n\n" + table(rows) + "\n"
    )
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
