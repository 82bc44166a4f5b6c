"""Where a pipeline run works, and the params.yaml overrides it was given.

Isolated runs: each run gets its own git worktree of the checkout's commit under
`<checkout>/.cache/workspaces/<run>` (`.cache` is git- and DVC-ignored), with DVC's cache shared
with the checkout. Two runs at once then never meet on DVC's stage locks (`'data/tokenizer' is
busy`) or on each other's outputs, the checkout stays clean, and what one run cached (the outputs
are cached) the next restores instead of recomputing. Only committed files are in a workspace.
A run holds its workspace's lock while it works and records its outcome there; after it, old
workspaces are pruned (dare_core/process/workspaces.py has the rule, `dare workspaces prune` applies it by hand).

Overrides (`rl.num_steps=200`) are written into the workspace's params.yaml through DVC's own YAML
round trip, the one `dvc exp run -S` uses, so DVC tracks them as params and the file keeps its
layout (params.yaml is kept a fixed point of that round trip; tests/test_params_layout.py).
"""
from __future__ import annotations

import difflib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from dare_core.storage import load_yaml
from dare_core.process.workspaces import (RECORD, WORKSPACES, WorkspaceError, claim, git, keep_setting, prune, record_run,
                                  release)

__all__ = ["WorkspaceError", "apply_overrides", "checkout_state", "create_workspace", "end_run", "parse_overrides"]


def _git(*args: str, cwd: Path) -> str:
    return git(*args, cwd=cwd).strip()


def checkout_state(repo: Path) -> tuple[str | None, list[str]]:
    """(HEAD commit, tracked files with uncommitted changes) of a git checkout; no commit yet: None."""
    proc = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=repo, capture_output=True, text=True)
    commit = proc.stdout.strip() or None
    return commit, changed_files(repo)


def changed_files(repo: Path) -> list[str]:
    """Tracked files with uncommitted changes. `-z` output: unquoted names, and no stripping that
    could eat the leading space of a status (` M prefect.yaml`, a change not yet staged)."""
    entries = iter(git("status", "--porcelain", "-z", "--untracked-files=no", cwd=repo).split("\0"))
    files = []
    for entry in entries:
        if len(entry) < 4:
            continue
        files.append(entry[3:])
        if entry[0] in "RC":  # a rename or copy: its source path follows as an entry of its own
            next(entries, None)
    return files


def dvc_cache_dir(repo: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "dvc", "cache", "dir"], cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkspaceError(f"`dvc cache dir` failed in {repo}: {proc.stderr.strip()}")
    return (repo / proc.stdout.strip().splitlines()[-1]).resolve()


def create_workspace(repo: str | Path, name: str) -> tuple[Path, str]:
    """A git worktree of `repo`'s HEAD at `<repo>/.cache/workspaces/<name>`, sharing its DVC cache.
    Returns (workspace, commit). An existing workspace of that name (a retried flow run) is reused."""
    repo = Path(repo).resolve()
    commit, _ = checkout_state(repo)
    if commit is None:
        raise WorkspaceError(f"an isolated run works on a commit, and {repo} has none yet: commit the project first")
    path = repo / WORKSPACES / name
    _exclude_locally(repo, f"/{WORKSPACES.as_posix()}/")
    _exclude_locally(repo, f"/{RECORD}")  # (the exclude file is shared by the workspaces)
    claim(path)  # before the worktree exists: a prune never takes a workspace half made
    try:
        _add_worktree(repo, path, commit)
    except BaseException:
        release(path)
        raise
    record_run(path, "running", commit=commit, pid=os.getpid())
    return path, commit


def _add_worktree(repo: Path, path: Path, commit: str) -> None:
    if not (path / ".git").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(5):  # concurrent `worktree add`s can meet on git's index lock
            try:
                _git("worktree", "add", "--detach", str(path), commit, cwd=repo)
                break
            except WorkspaceError:
                if attempt == 4:
                    raise
                time.sleep(0.5 + attempt)
    share_dvc_cache(repo, path)


def share_dvc_cache(repo: Path, path: Path) -> None:
    """Have the workspace at `path` use `repo`'s DVC cache (its local config, not the committed one)."""
    cache = dvc_cache_dir(repo)
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "dvc", "cache", "dir", "--local", str(cache)], cwd=path,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkspaceError(f"could not share the DVC cache {cache} with {path}: {proc.stderr.strip()}")


def end_run(repo: str | Path, workspace: Path, status: str, say: Callable[[str], None] = print,
            warn: Callable[[str], None] = print) -> None:
    """Record the run's outcome (`ran` or `failed`) in its workspace, let the workspace go, and prune
    the checkout's workspaces as DARE_KEEP_WORKSPACES says (dare_core/process/workspaces.py). A prune that
    cannot run is a warning: the run's own outcome stands."""
    try:
        record_run(workspace, status)
    except OSError as exc:  # (a full disk): the prune then takes the run as killed
        warn(f"the outcome of the run was not recorded in {workspace}: {exc}")
    finally:
        release(workspace)
    try:
        keep = keep_setting()
        if keep is not None:
            prune(repo, keep, say=say)
    except (OSError, ValueError) as exc:
        warn(f"old workspaces not pruned: {exc}")


def _exclude_locally(repo: Path, pattern: str) -> None:
    """Keep the workspaces out of `git status` of the checkout, whatever its .gitignore says."""
    exclude = repo / _git("rev-parse", "--git-path", "info/exclude", cwd=repo)
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if pattern not in lines:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with open(exclude, "a") as f:
            f.write(("\n" if lines and lines[-1] else "") + pattern + "\n")


def parse_overrides(overrides: list[str]) -> list[tuple[str, object]]:
    parsed = []
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} must look like key.sub=value (e.g. rl.num_steps=200)")
        # read as `dare stage -S` reads a value: a key given twice is refused, not silently dropped
        parsed.append((key.strip(), load_yaml(value, prefix=key.strip())))
    return parsed


def apply_overrides(params_file: str | Path, overrides: list[str]) -> list[tuple[str, object]]:
    """Set dotted keys of params.yaml in place. Every key must already exist (a typo fails with a
    suggestion before anything runs); values are YAML (`200`, `1e-5`, `null`, `[a, b]`)."""
    from dvc.utils.serialize._yaml import dumps_yaml, parse_yaml_for_update

    params_file = Path(params_file)
    parsed = parse_overrides(overrides)
    text = params_file.read_text()
    tree = parse_yaml_for_update(text, str(params_file))
    for key, value in parsed:
        node = tree
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                where = ".".join(parts[:depth]) or "the top level"
                known = list(node) if isinstance(node, dict) else []
                near = difflib.get_close_matches(part, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(map(str, known))})"
                raise ValueError(f"override {key!r}: {params_file.name} has no key {part!r} under {where}{hint}")
            if depth < len(parts) - 1:
                node = node[part]
        node[parts[-1]] = value
    tmp = params_file.with_name(f".{params_file.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps_yaml(tree))
    tmp.replace(params_file)
    return parsed
