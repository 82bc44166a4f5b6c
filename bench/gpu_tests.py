"""Run the GPU-marked tests (CI has no GPU and skips them) and write bench/results/gpu_tests.md.

    python3 bench/gpu_tests.py                      # every `gpu`-marked test under tests/
    python3 bench/gpu_tests.py tests/dare_core/models/test_load_export.py    # some of them

The file holds the commit, the command, the hardware and the date, pytest's summary line and its
per-test outcomes (`-rA`), so what passed on which machine is read, not typed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    if os.environ.get("DARE_COMMIT"):  # a copy of the tree without a usable .git (the device machine)
        return os.environ["DARE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (set DARE_COMMIT)"


def hardware() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help="test files (default: every file under tests/ that marks a test gpu)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_tests.md"))
    p.add_argument("--timeout", type=float, default=540, help="seconds for the whole pytest run")
    args = p.parse_args(argv)
    paths = args.paths or sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                                 if "mark.gpu" in f.read_text())
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rA", "-p", "no:cacheprovider", *paths]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = (exc.stdout or b"").decode(errors="replace") + f"\n(stopped after {args.timeout:.0f} s)", None
    lines = output.splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), "(no summary line)")
    outcomes = [ln for ln in lines if re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ", ln)]
    failures = output.split("= FAILURES =", 1)[1][:6000] if "= FAILURES =" in output else ""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    shown = "python3 bench/gpu_tests.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = [
        "# GPU-marked tests on the device machine", "",
        f"Git commit: {git_commit()}  ", f"Command: `{shown.strip()}` (runs `{' '.join(cmd[1:])}`) ({date})  ",
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
