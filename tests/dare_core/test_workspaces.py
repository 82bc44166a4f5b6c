"""Pruning the workspaces of isolated runs: real git worktrees, real locks held by live processes."""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time

import pytest

from dare_core.cli import main
from dare_core.errors import UserError
from dare_core.process.workspaces import RECORD, WORKSPACES, claim, keep_setting, prune, release
from git_repos import committed_repo, git

HOUR = 3600.0


@pytest.fixture
def repo(tmp_path):
    return committed_repo(tmp_path / "project", {"params.yaml": "a: 1\n", "big.bin": "x" * 200_000})


def workspace(repo, name, status=None, hours_ago=0.0):
    """A worktree under .cache/workspaces whose run ended (or, `running`, started) `hours_ago`."""
    path = repo / WORKSPACES / name
    git(repo, "worktree", "add", "-q", "--detach", str(path))
    if status is not None:
        # from the clock of this call: the dry run below reads ages against the clock as it runs
        when = dt.datetime.fromtimestamp(time.time() - hours_ago * HOUR, dt.timezone.utc).isoformat()
        (path / RECORD).write_text(json.dumps({"status": status, "started" if status == "running" else "ended": when}))
    return path


def worktrees(repo):
    return {line.split(" ", 1)[1] for line in git(repo, "worktree", "list", "--porcelain").splitlines() if line.startswith("worktree ")}


def test_the_rule_keeps_the_newest_the_recently_failed_and_the_running(repo):
    ran = [workspace(repo, f"ran-{i}", "ran", hours_ago=i + 1) for i in range(3)]
    failed_recently, failed_long_ago = workspace(repo, "typo", "failed", 2.5), workspace(repo, "old-failure", "failed", 30)
    died = workspace(repo, "killed", "running", 40)  # left `running`, its lock free: the run was killed
    running = workspace(repo, "in-progress", "running", 0.1)
    (ran[2] / "runs").mkdir()  # a run's outputs: untracked, read-only (DVC's links to its cache are)
    (ran[2] / "runs" / "out.bin").write_bytes(b"o" * 100_000)
    (ran[2] / "runs" / "out.bin").chmod(0o444)
    claim(running)  # ... and this one's run holds its lock
    stranger = repo / WORKSPACES / "not-a-worktree"
    (stranger / "sub").mkdir(parents=True)
    (stranger / "sub" / "keep.txt").write_text("mine")
    lines: list[str] = []
    try:
        assert prune(repo, keep=2, failed_for_h=24, say=lines.append, now=time.time()) == 3
    finally:
        release(running)
    gone = {ran[2], failed_long_ago, died}
    for path in [*ran, failed_recently, failed_long_ago, died, running]:
        assert path.exists() == (path not in gone), path
    assert worktrees(repo) == {str(repo)} | {str(p) for p in [ran[0], ran[1], failed_recently, running]}
    assert (stranger / "sub" / "keep.txt").read_text() == "mine"  # never DARE's to remove
    by_name = {line.split()[1].rsplit("/", 1)[-1]: line for line in lines[:-1]}
    assert by_name["in-progress"].startswith("kept") and "in use by a run in progress" in by_name["in-progress"]
    assert by_name["ran-0"].startswith("kept") and "one of the newest 2" in by_name["ran-0"]
    assert by_name["typo"].startswith("kept") and "failed 2.5 h ago: a failed run's, kept 24 h" in by_name["typo"]
    assert by_name["ran-2"].startswith("removed") and "(ran 3.0 h ago)" in by_name["ran-2"]
    assert by_name["killed"].startswith("removed") and "(died 40.0 h ago)" in by_name["killed"]
    assert by_name["not-a-worktree"].startswith("left") and "not DARE's to remove" in by_name["not-a-worktree"]
    assert all(" MB  (" in line for name, line in by_name.items() if name != "not-a-worktree")
    assert "0.3 MB" in by_name["ran-2"] and "0.2 MB" in by_name["ran-1"]  # sizes: 200 kB of files, and its outputs
    assert lines[-1] == "removed 3 workspace(s), 0.7 MB; kept 4"
    assert not (repo / WORKSPACES / "ran-2.lock").exists()


def test_a_lock_held_by_another_live_process_is_never_pruned(repo):
    path = workspace(repo, "elsewhere", "ran", 100)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dare_core.process.workspaces import claim; "
                               f"claim(__import__('pathlib').Path({str(path)!r})); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert prune(repo, keep=0, failed_for_h=0, say=lambda _: None) == 0 and path.exists()
    finally:
        holder.kill()
        holder.wait()
    # its process gone, the kernel dropped the lock: the workspace is an ended one like the others
    assert prune(repo, keep=0, failed_for_h=0, say=lambda _: None) == 1 and not path.exists()


def test_dare_workspaces_prune_dry_run_from_inside_a_workspace(repo, capsys, monkeypatch):
    old, new = workspace(repo, "old", "ran", 10), workspace(repo, "new", "ran", 1)
    monkeypatch.setenv("DARE_KEEP_WORKSPACES", "1")
    assert main(["workspaces", "prune", "--dry-run", "--repo", str(new)]) == 0  # the checkout found from a workspace
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("kept         .cache/workspaces/new  ") and out[0].endswith("(ran 1.0 h ago: one of the newest 1)")
    assert out[1].startswith("would remove .cache/workspaces/old  ") and out[-1].startswith("would remove 1 workspace(s)")
    assert old.exists() and new.exists()
    assert main(["workspaces", "prune", "--repo", str(repo), "--keep", "0", "--failed-for", "1"]) == 0
    assert not old.exists() and not new.exists() and worktrees(repo) == {str(repo)}


def test_the_keep_setting():
    assert keep_setting({}) == 10 and keep_setting({"DARE_KEEP_WORKSPACES": "3"}) == 3
    assert keep_setting({"DARE_KEEP_WORKSPACES": "off"}) is None
    with pytest.raises(UserError, match="DARE_KEEP_WORKSPACES must be a number of workspaces"):
        keep_setting({"DARE_KEEP_WORKSPACES": "-1"})


def test_a_workspace_git_will_not_remove_is_named_and_the_others_still_go(repo):
    from dare_core.process.workspaces import WorkspaceError

    pinned, old = workspace(repo, "pinned", "ran", 50), workspace(repo, "old", "ran", 60)
    git(repo, "worktree", "lock", "--reason", "kept by hand", str(pinned))  # `git worktree lock`: a user's wish
    lines: list[str] = []
    with pytest.raises(WorkspaceError, match=r"1 workspace\(s\) could not be removed; the first: git worktree remove"):
        prune(repo, keep=0, failed_for_h=0, say=lines.append)
    assert pinned.exists() and not old.exists()
    assert lines[0].startswith("not removed  .cache/workspaces/pinned") and lines[1].startswith("removed      .cache/workspaces/old")
