"""Throwaway git repositories for tests of workspaces and checkout state."""
from __future__ import annotations

import subprocess
from pathlib import Path

# an identity for the commits, whatever the machine's git config holds
GIT = ["git", "-c", "user.name=dare-test", "-c", "user.email=dare-test@localhost", "-c", "commit.gpgsign=false"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def committed_repo(repo: Path, files: dict[str, str]) -> Path:
    """A git repository at `repo` holding `files` (name -> text) in one commit."""
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q")
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "init")
    return repo
