"""Run the GPU-marked tests (CI has no GPU and skips them) and write bench/results/gpu_tests.md.

    python3 bench/gpu_tests.py                      # every `gpu`-marked test under tests/
    python3 bench/gpu_tests.py tests/dare_core/models/test_load_export.py    # some of them

The file holds the commit, the command, the hardware and the date, pytest's summary line and its
per-test outcomes (`-v`, and the reasons of skips and failures), so what passed on which machine is read, not typed.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from stamp import REPO, git_commit, hardware, library_versions, utc_now


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help="test files (default: every file under tests/ that marks a test gpu)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_tests.md"))
    p.add_argument("--timeout", type=float, default=540, help="seconds for the whole pytest run")
    args = p.parse_args(argv)
    paths = args.paths or sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                                 if "mark.gpu" in f.read_text())
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-rfEs", "-p", "no:cacheprovider", *paths]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    log = Path(args.out).with_suffix(".log")
    with log.open("w") as f:  # streamed, so that a run stopped at the time limit keeps what it printed
        try:
            code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    output = log.read_text(errors="replace") + (f"\n(stopped after {args.timeout:.0f} s)" if code is None else "")
    log.unlink()
    lines = output.splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", ln)), "(no summary line)")
    outcomes = [ln for ln in lines if re.search(r"::\S+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", ln)
                or re.match(r"(FAILED|ERROR|SKIPPED) ", ln)]
    failures = output.split("= FAILURES =", 1)[1][:6000] if "= FAILURES =" in output else ""
    date = utc_now()
    shown = "python3 bench/gpu_tests.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = [
        "# GPU-marked tests on the device machine", "",
        f"Git commit: {git_commit()}  ", f"Libraries: {library_versions()}  ", f"Command: `{shown.strip()}` (runs `{' '.join(cmd[1:])}`) ({date})  ",
        f"Hardware: {hardware()}", "",
        f"Result: {summary.strip('= ')} (pytest exit code {code})", "",
        "```", *outcomes, "```", "",
    ]
    if failures:
        text += ["## Failures (first 6000 characters)", "", "```", failures, "```", ""]
    Path(args.out).write_text("\n".join(text))
    print("\n".join(text))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
