"""The workspaces of isolated runs, and the rule that removes old ones (`dare workspaces prune`).

An isolated flow run works in a git worktree `<checkout>/.cache/workspaces/<name>` (tasks/workspace.py
makes it). Each holds a copy of the checkout's files and the run's outputs (81 MB for the tiny
model), so they are pruned: after each isolated run, and by hand. The rule:

- a workspace in use is never removed: its run holds an exclusive lock on `<name>.lock` beside it for
  as long as it runs (`flock`, which the kernel releases when the process dies, however it dies);
- of the others, the newest `keep` are kept (by the time their run ended; `DARE_KEEP_WORKSPACES`,
  default 10);
- a failed run's workspace is kept `failed_for` hours (default 24) after it ended, to be inspected;
- the rest are removed with `git worktree remove --force`, then `git worktree prune`.

A run records how it went in `<workspace>/.dare-run.json` (`running`, then `ran` or `failed`). One
left `running` whose lock nobody holds was killed: it counts as failed. Only registered worktrees of
the checkout under `.cache/workspaces/` are ever removed; nothing is deleted any other way.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from dare_core.errors import UserError
from dare_core.storage import atomic_write_json

WORKSPACES = Path(".cache") / "workspaces"
RECORD = ".dare-run.json"
KEEP_ENV = "DARE_KEEP_WORKSPACES"
DEFAULT_KEEP = 10
DEFAULT_FAILED_FOR_H = 24.0

_held: dict[str, int] = {}  # lock file -> the descriptor holding it, for the runs of this process


class WorkspaceError(UserError):
    """A git command on the checkout or its workspaces failed."""


def git(*args: str, cwd: Path) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkspaceError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def main_checkout(repo: str | Path) -> Path:
    """The checkout whose `.cache/workspaces` holds the workspaces: `repo` itself, or the checkout a
    worktree (a workspace, say) belongs to."""
    common = Path(git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=Path(repo)).strip())
    if common.name != ".git":
        raise WorkspaceError(f"{repo} is not in a git checkout with a working tree (its git folder is {common})")
    return common.parent


def lock_file(workspace: Path) -> Path:
    return workspace.with_name(workspace.name + ".lock")


def _try_lock(path: Path) -> Optional[int]:
    """A descriptor holding `path`'s exclusive lock, or None while another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def claim(workspace: Path) -> None:
    """Mark `workspace` in use by this process until `release` (or the process's end): taken before
    the worktree exists, so a prune never meets a workspace half made."""
    path = lock_file(workspace)
    if str(path) in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _try_lock(path)
    if fd is None:
        raise WorkspaceError(f"workspace {workspace} is in use by another run (it holds {path})")
    _held[str(path)] = fd


def release(workspace: Path) -> None:
    fd = _held.pop(str(lock_file(workspace)), None)
    if fd is not None:
        os.close(fd)  # (closing the descriptor drops the lock)


def record_run(workspace: Path, status: str, **details: object) -> None:
    """Write how the workspace's run went (`running`, `ran`, `failed`) into its `.dare-run.json`."""
    record = _read_record(workspace)
    now = dt.datetime.now(dt.timezone.utc).isoformat()  # (to the microsecond: runs that end in one second keep their order)
    record.update(details, status=status, **({"started": now} if status == "running" else {"ended": now}))
    atomic_write_json(workspace / RECORD, record)


def _read_record(workspace: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((workspace / RECORD).read_text())
        if isinstance(record, dict):
            return record
    return {}


@dataclass
class Workspace:
    path: Path
    status: str  # ran | failed | died (left `running`, its lock free) | running (in use) | unknown (no record)
    time: float  # when its run ended (started, for one in use); the folder's time without a record
    size: int  # bytes

    @property
    def failed(self) -> bool:
        return self.status in ("failed", "died")


def _timestamp(text: object, fallback: float) -> float:
    with contextlib.suppress(TypeError, ValueError):
        return dt.datetime.fromisoformat(str(text)).timestamp()
    return fallback


def _size(path: Path) -> int:
    """Bytes under `path`, each file once (links not followed)."""
    seen, total = set(), 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def _registered(checkout: Path) -> set[Path]:
    out = git("worktree", "list", "--porcelain", cwd=checkout)
    return {Path(line[len("worktree "):]).resolve() for line in out.splitlines() if line.startswith("worktree ")}


def _inspect(path: Path) -> Workspace:
    record, mtime = _read_record(path), path.stat().st_mtime
    fd = _try_lock(lock_file(path)) if lock_file(path).exists() else None
    in_use = lock_file(path).exists() and fd is None
    if fd is not None:
        os.close(fd)
    status = "running" if in_use else record.get("status", "unknown")
    if status == "running" and not in_use:
        status = "died"
    ended = record.get("started") if status in ("running", "died") else record.get("ended")
    return Workspace(path, status, _timestamp(ended, mtime), _size(path))


def find_workspaces(checkout: Path) -> tuple[list[Workspace], list[Path]]:
    """(the registered worktrees under `.cache/workspaces`, the other folders there)."""
    root = checkout / WORKSPACES
    if not root.is_dir():
        return [], []
    registered = _registered(checkout)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    workspaces = []
    for path in (p for p in folders if p.resolve() in registered):
        with contextlib.suppress(FileNotFoundError):  # (another prune removed it meanwhile)
            workspaces.append(_inspect(path))
    return workspaces, [p for p in folders if p.resolve() not in registered]


def plan(workspaces: list[Workspace], keep: int, failed_for_h: float, now: float) -> list[tuple[Workspace, bool, str]]:
    """(workspace, remove?, why) for each: in use kept, then the newest `keep`, then failed runs for
    `failed_for_h` hours after they ended; the rest removed. Newest first."""
    decisions = []
    done = 0
    for ws in sorted(workspaces, key=lambda w: w.time, reverse=True):
        age = f"{ws.status} {_age(now - ws.time)} ago"
        if ws.status == "running":
            decisions.append((ws, False, f"in use by a run in progress, started {_age(now - ws.time)} ago"))
            continue
        done += 1
        if done <= keep:
            decisions.append((ws, False, f"{age}: one of the newest {keep}"))
        elif ws.failed and now - ws.time < failed_for_h * 3600:
            decisions.append((ws, False, f"{age}: a failed run's, kept {failed_for_h:g} h to be inspected"))
        else:
            decisions.append((ws, True, age))
    return decisions


def prune(repo: str | Path, keep: int, failed_for_h: float = DEFAULT_FAILED_FOR_H, dry_run: bool = False,
          say: Callable[[str], None] = print, now: Optional[float] = None) -> int:
    """Apply the rule to the workspaces of `repo`'s checkout, one line each; the number removed (or,
    with `dry_run`, that would be)."""
    if keep < 0 or failed_for_h < 0:
        raise UserError(f"keep ({keep}) and failed_for ({failed_for_h:g} h) must be >= 0")
    checkout = main_checkout(repo)
    workspaces, strangers = find_workspaces(checkout)
    removed = freed = 0
    failures = []
    for ws, remove, why in plan(workspaces, keep, failed_for_h, dt.datetime.now().timestamp() if now is None else now):
        where = f"{ws.path.relative_to(checkout)}  {_mb(ws.size)}"
        if remove and not dry_run:
            with _locked(ws.path) as free:
                if not free:  # a run took it since it was looked at
                    say(f"{'kept':<12} {where}  (in use by a run that just started)")
                    continue
                try:
                    git("worktree", "remove", "--force", str(ws.path), cwd=checkout)
                except WorkspaceError as exc:
                    failures.append(str(exc))
                    say(f"{'not removed':<12} {where}  ({exc})")
                    continue
        if remove:
            removed, freed = removed + 1, freed + ws.size
        say(f"{('would remove' if dry_run else 'removed') if remove else 'kept':<12} {where}  ({why})")
    for path in strangers:
        say(f"{'left':<12} {path.relative_to(checkout)}  (not a git worktree of {checkout}: not DARE's to remove)")
    if not dry_run:
        git("worktree", "prune", cwd=checkout)
        for orphan in (checkout / WORKSPACES).glob("*.lock"):
            if not orphan.with_suffix("").exists():  # its workspace was removed by hand
                with _locked(orphan.with_suffix("")):
                    pass
    kept = len(workspaces) - removed
    say(f"{'would remove' if dry_run else 'removed'} {removed} workspace(s), {_mb(freed)}; kept {kept}")
    if failures:
        raise WorkspaceError(f"{len(failures)} workspace(s) could not be removed; the first: {failures[0]}")
    return removed


@contextlib.contextmanager
def _locked(workspace: Path) -> Iterator[bool]:
    """Hold the workspace's lock while it is removed (True), or say it is taken (False); its lock file
    goes with it."""
    path = lock_file(workspace)
    fd = _try_lock(path)
    try:
        yield fd is not None
        if fd is not None:
            path.unlink(missing_ok=True)
    finally:
        if fd is not None:
            os.close(fd)


def keep_setting(environ: Optional[dict] = None) -> Optional[int]:
    """How many ended workspaces the automatic prune keeps: `DARE_KEEP_WORKSPACES` (default 10);
    `off` turns the automatic prune off (None)."""
    value = (os.environ if environ is None else environ).get(KEEP_ENV, "").strip()
    if value.lower() == "off":
        return None
    if not value:
        return DEFAULT_KEEP
    if not value.isdigit():
        raise UserError(f"{KEEP_ENV} must be a number of workspaces (>= 0) or 'off', got {value!r}")
    return int(value)


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} d"


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
