"""The commit a benchmark's results file names."""
from __future__ import annotations

import datetime
import os
import re
import subprocess
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The checkout's commit; DARE_COMMIT, when set, names it instead (a copy of the tree whose .git
    is absent or stale, as on the remote GPU machine). It must be a whole 40-digit hash, as
    `git rev-parse HEAD` prints it where the commit exists: a short one typed by hand can name a
    commit that is not there (a results file of 2026-11-27 named ff06b86e for ff06b86c)."""
    given = os.environ.get("DARE_COMMIT")
    if given:
        if not re.fullmatch(r"[0-9a-f]{40}", given):
            raise SystemExit(f"DARE_COMMIT={given!r}: give the whole hash, e.g. DARE_COMMIT=$(git rev-parse HEAD) "
                             "in the checkout where the commit exists")
        return given

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


def library_versions(names: tuple[str, ...] = ("torch", "deepspeed", "opencompass", "peft", "prefect", "dvc")) -> str:
    """Installed versions of the libraries a result depends on ("absent" where not installed)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return ", ".join(f"{n} {version(n)}" for n in names)


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what `platform` knows)."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        return model


def usable_cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def header(title: str, command: str, hardware: str, commit: Optional[str] = None, libraries: Optional[str] = None,
           date: Optional[str] = None) -> list[str]:
    """The top of a results file: what ran, at which commit (`commit`: as read when the run began;
    default: now), where, with what (default: installed here), when (default: now)."""
    return [f"# {title}", "", f"Git commit: {commit or git_commit()}  ", f"Command: `{command}`  ", f"Hardware: {hardware}  ",
            f"Libraries: {libraries or library_versions()}  ", f"Date: {date or utc_now()}", ""]
