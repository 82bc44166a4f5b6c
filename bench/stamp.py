"""The commit a benchmark's results file names."""
from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The checkout's commit; DARE_COMMIT, when set, names it instead (a copy of the tree whose .git
    is absent or stale, as on the remote GPU machine)."""
    if os.environ.get("DARE_COMMIT"):
        return os.environ["DARE_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout here; set DARE_COMMIT)"
    return sha + (" + uncommitted changes" if dirty else "")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
