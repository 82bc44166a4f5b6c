"""Time `make run` on a fresh clone of this repository and write bench/results/make_run.md.

    python3 bench/make_run.py            # clones HEAD beside this checkout (next to ../shared)

Two phases, each timed: `make venv` (the install) and `make run` (the embedded pipeline: prepare,
SFT, RL, convert, eval through Prefect). The stage table and the held-out accuracies are the ones
`make run` prints at its end; nothing in the results file is typed by hand.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from stamp import REPO, library_versions, markdown_table, utc_now


def timed(cmd: list[str], cwd: Path, log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("a") as f:
        subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def pipeline_summary(log: Path) -> list[str]:
    """What `make run` prints at its end: the stage table (wall time per stage) and the eval table."""
    lines = log.read_text(errors="replace").splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith("DARE pipeline (")), default=None)
    if start is None:
        raise SystemExit(f"{log}: no pipeline summary; did make run finish?")
    return [line for line in lines[start + 1:] if line.startswith("|") or line.strip() == "Evaluation (accuracy %)"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clone", default=str(REPO.parent / "make-run-bench"), help="where the fresh clone goes (removed first)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "make_run.md"))
    args = p.parse_args()
    clone = Path(args.clone)
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True).stdout.strip()
    log = clone / "make_run.log"
    env_note = "pip cache warm" if Path(os.path.expanduser("~/.cache/pip")).exists() else "pip cache empty"
    venv_s = timed(["make", "venv"], clone, log)
    run_s = timed(["make", "run"], clone, log)
    lines = [
        "# `make run` on a fresh clone", "",
        f"Git commit: {commit}  ", f"Libraries: {library_versions()}  ",
        f"Command: `python3 bench/make_run.py` (git clone, then `make venv` and `make run`, each timed) ({utc_now()})  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU needed, Python {platform.python_version()}, {env_note}", "",
        *markdown_table(["phase", "wall time (s)"], [
            ["`make venv` (torch CPU build, requirements, DeepSpeed, editable install)", f"{venv_s:.1f}"],
            ["`make run` (the whole pipeline, with Prefect's start)", f"{run_s:.1f}"]]),
    ]
    lines += ["", "The summary `make run` printed at its end (stages, then held-out accuracy %):", ""]
    lines += [line if line.startswith("|") else f"\n{line}:\n" for line in pipeline_summary(log)] + [""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
