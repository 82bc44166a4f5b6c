"""The checkout state an isolated run reports: its commit and the tracked files it leaves out."""
from __future__ import annotations

from git_repos import committed_repo, git
from tasks.workspace import checkout_state


def test_an_unstaged_change_listed_first_keeps_its_whole_name(tmp_path):
    repo = committed_repo(tmp_path / "repo", {"prefect.yaml": "a: 1\n", "z.txt": "z\n"})
    # ` M prefect.yaml`: a change not staged; its status line, the first, starts with a space
    (repo / "prefect.yaml").write_text("a: 2\n")
    (repo / "untracked.txt").write_text("n\n")  # not part of a commit either way: not named
    commit, dirty = checkout_state(repo)
    assert commit == git(repo, "rev-parse", "HEAD").strip()
    assert dirty == ["prefect.yaml"]


def test_staged_renamed_and_spaced_names_are_named_as_they_are(tmp_path):
    repo = committed_repo(tmp_path / "repo", {"dvc.yaml": "stages: {}\n", "old name.txt": "x\n", "params.yaml": "a: 1\n"})
    git(repo, "mv", "old name.txt", "new name.txt")  # `R  new name.txt`, its old name after it
    (repo / "dvc.yaml").write_text("stages: {s: {cmd: x}}\n")
    git(repo, "add", "dvc.yaml")  # `M  dvc.yaml`
    (repo / "params.yaml").write_text("a: 2\n")  # ` M params.yaml`, after the others
    assert sorted(checkout_state(repo)[1]) == ["dvc.yaml", "new name.txt", "params.yaml"]


def test_a_clean_checkout_has_nothing_to_name(tmp_path):
    repo = committed_repo(tmp_path / "repo", {"prefect.yaml": "a: 1\n"})
    assert checkout_state(repo)[1] == []


def test_a_run_holds_its_workspace_and_the_prune_after_it_keeps_the_newest(tmp_path, monkeypatch):
    import json

    import tasks.workspace
    from dare_core.process.workspaces import RECORD, prune
    from tasks.workspace import create_workspace, end_run

    repo = committed_repo(tmp_path / "repo", {"params.yaml": "a: 1\n"})
    monkeypatch.setattr(tasks.workspace, "share_dvc_cache", lambda repo, path: None)  # (no DVC project here)
    monkeypatch.setenv("DARE_KEEP_WORKSPACES", "1")
    first, commit = create_workspace(repo, "first")
    assert json.loads((first / RECORD).read_text())["status"] == "running"
    assert prune(repo, keep=0, say=lambda _: None) == 0 and first.exists()  # in use while its run works
    assert git(first, "status", "--porcelain") == ""  # its record is no change of the workspace's files
    lines: list[str] = []
    end_run(repo, first, "ran", say=lines.append)
    assert json.loads((first / RECORD).read_text())["status"] == "ran" and first.exists()  # the newest one
    second, _ = create_workspace(repo, "second")
    end_run(repo, second, "ran", say=lines.append)
    assert second.exists() and not first.exists()
    assert lines[-1] == "removed 1 workspace(s), " + lines[-1].split(", ")[1] and lines[-1].endswith("; kept 1")
    monkeypatch.setenv("DARE_KEEP_WORKSPACES", "off")
    third, _ = create_workspace(repo, "third")
    end_run(repo, third, "failed", say=lines.append)
    assert second.exists() and third.exists() and lines[-1].endswith("; kept 1")  # no prune ran
