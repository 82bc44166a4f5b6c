"""The Prefect pipeline flow against a throwaway DVC repo: real Prefect (ephemeral), real DVC.

Prefect's ephemeral server takes ~20 s to start on a fresh PREFECT_HOME, once per process; every
flow run after that costs about a second. So the tests of this module share one PREFECT_HOME and its
server (each in a repo of its own; what they read back from Prefect is their own runs' or the latest).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

EVAL_JSON = {
    "base": {"arithmetic": 2.0, "gsm8k": 0.5},
    "sft": {"arithmetic": 61.0, "gsm8k": 10.25},
    "rl": {"arithmetic": 74.0, "gsm8k": 12.0},
    "artifacts": {"base": "runs/embedded/base", "sft": "runs/embedded/sft/model", "rl": "models/embedded"},
}

EVAL_PY = f"""\
import json, os
os.makedirs("metrics", exist_ok=True)
with open("log.txt", "a") as f:
    f.write("eval\\n")
with open("metrics/eval.json", "w") as f:
    json.dump({EVAL_JSON!r}, f)
"""

DVC_YAML = """\
stages:
  prepare:
    cmd: echo prepare >> log.txt && echo data > prepare.out
    params: [prepare.n]
    outs: [prepare.out]
  sft:
    cmd: echo sft >> log.txt && cat prepare.out > sft.out
    deps: [prepare.out]
    outs: [sft.out]
  preference:
    cmd: echo preference >> log.txt && cat sft.out > preference.out
    deps: [sft.out]
    outs: [preference.out]
  rl:
    cmd: echo rl >> log.txt && cat sft.out params.yaml > rl.out
    deps: [sft.out]
    params: [rl.lr]
    outs: [rl.out]
  convert:
    # fails the first time (exit 3), succeeds on the retry
    cmd: (test -f .convert_failed_once || (touch .convert_failed_once && exit 3)) && echo convert >> log.txt && cat rl.out > convert.out
    deps: [rl.out]
    outs: [convert.out]
  eval:
    cmd: python eval.py
    deps: [convert.out, eval.py]
    metrics:
      - metrics/eval.json:
          cache: false
  boom:
    cmd: exit 7
"""


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory):
    """Hermetic ephemeral Prefect: fresh PREFECT_HOME, no server URL, generous startup timeout; one per module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect_home")))
        mp.delenv("PREFECT_API_URL", raising=False)
        mp.delenv("PREFECT_PROFILE", raising=False)
        mp.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
        mp.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        mp.setenv("DO_NOT_TRACK", "1")
        mp.setenv("DVC_NO_ANALYTICS", "1")
        import prefect.context

        prefect.context.refresh_global_settings_context()  # in case prefect was imported earlier
        yield
        # Flush Prefect's background log/event workers and stop the ephemeral server now, while
        # pytest's output capture is still open (not at interpreter exit).
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker
        from prefect.server.api.server import SubprocessASGIServer

        APILogWorker.drain_all(timeout=10, at_exit=False)
        EventsWorker.drain_all(timeout=10, at_exit=False)
        logging.disable(logging.INFO)  # its "Stopping temporary server" would hit a closed capture
        try:
            SubprocessASGIServer().stop()
        finally:
            logging.disable(logging.NOTSET)
    prefect.context.refresh_global_settings_context()


def _make_repo(root: Path) -> None:
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "params.yaml").write_text("prepare:\n  n: 10\nrl:\n  lr: 0.1\n")
    (root / "eval.py").write_text(EVAL_PY)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)


def _log(root: Path) -> list[str]:
    return (root / "log.txt").read_text().split()


def test_pipeline_runs_skips_retries_and_reports(tmp_path, prefect_env, capsys):
    from flows.pipeline import dare_pipeline
    from prefect.artifacts import Artifact
    from tasks.dvc_stage import StageFailed

    _make_repo(tmp_path)
    stages = ["prepare", "sft", "preference", "rl", "convert", "eval"]

    # (1) + (3): all six run in order; convert fails once (exit 3) and is retried.
    res = dare_pipeline(repo=str(tmp_path), retry_delay_seconds=0)
    assert _log(tmp_path) == stages
    assert [r.stage for r in res.stages] == stages
    assert res.ran == stages and res.skipped == []
    assert {r.stage: r.attempts for r in res.stages} == {s: 2 if s == "convert" else 1 for s in stages}
    assert res.metrics == EVAL_JSON
    lines = res.table.splitlines()
    assert lines[0] == "| checkpoint | arithmetic | gsm8k | artifact path |"
    assert lines[2:] == [
        "| base | 2.0 | 0.5 | `runs/embedded/base` |",
        "| sft | 61.0 | 10.2 | `runs/embedded/sft/model` |",
        "| rl | 74.0 | 12.0 | `models/embedded` |",
    ]
    out = capsys.readouterr().out
    assert res.table in out and "| convert | ran | 2 |" in out
    artifact = Artifact.get("dare-eval-table")
    assert artifact is not None and res.table in artifact.data

    # (2): nothing changed, everything is skipped.
    res = dare_pipeline(repo=str(tmp_path))
    assert _log(tmp_path) == stages
    assert res.skipped == stages and res.ran == []
    assert res.table is not None
    assert "| prepare | skipped |" in capsys.readouterr().out

    # (4): a param only rl reads: rl, convert and eval rerun, prepare, sft and preference do not.
    (tmp_path / "params.yaml").write_text("prepare:\n  n: 10\nrl:\n  lr: 0.2\n")
    res = dare_pipeline(repo=str(tmp_path))
    assert _log(tmp_path) == stages + ["rl", "convert", "eval"]
    assert res.skipped == ["prepare", "sft", "preference"] and res.ran == ["rl", "convert", "eval"]

    # A stage that keeps failing: a clear error naming the stage and its cmd's exit code.
    with pytest.raises(StageFailed, match=r"stage 'boom' failed with exit code 7") as err:
        dare_pipeline(stages=["boom"], repo=str(tmp_path), retries=0)
    assert err.value.returncode == 7 and "failed to reproduce 'boom'" in str(err.value)
    # An unknown stage fails before anything runs.
    with pytest.raises(ValueError, match="nope"):
        dare_pipeline(stages=["prepare", "nope"], repo=str(tmp_path))


CHATTY_PY = """\
import sys
import time
for i in range(1, 4):
    print(f"step {i} loss {3.0 / i:.3f}", flush=True)
for j in range(200):  # a progress bar: 200 redraws, one line in the end
    sys.stderr.write(f"\\rsampling {j + 1}/200")
sys.stderr.write("\\n")
sys.stderr.flush()
time.sleep(0.5)
for j in range(300):  # a flood of lines: the rate limit keeps most of them out of Prefect
    print(f"noise {j}")
"""

TYPO_PY = """\
import sys
print("loading params.yaml", flush=True)
print("error: params.yaml: unknown config key 'sft.max_step' (did you mean 'max_steps'?)", file=sys.stderr)
sys.exit(2)
"""


def _task_logs(flow_run_id, levels: bool = False) -> dict[str, list[str]]:
    """Task run name -> its log messages (`levels`: (level, message) pairs), after Prefect's log
    worker has sent them."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10, at_exit=False)

    async def read():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            names = {r.id: r.name for r in runs}
            states = {r.name: r.state.message for r in runs}
            out: dict[str, list[str]] = {}
            for log in logs:
                out.setdefault(names.get(log.task_run_id, "flow"), []).append((log.level, log.message) if levels else log.message)
            return out, states

    return asyncio.run(read())


def _artifact_versions(key: str) -> int:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def count():
        async with get_client() as client:
            return len(await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))))

    return asyncio.run(count())


def test_prefect_sees_stage_output_errors_overrides_and_isolated_runs(tmp_path, prefect_env, capsys):
    from flows.pipeline import dare_pipeline
    from prefect.artifacts import Artifact
    from tasks.dvc_stage import StageFailed

    _make_repo(tmp_path)
    with open(tmp_path / "dvc.yaml", "a") as f:
        f.write("  chatty:\n    cmd: python chatty.py\n  typo:\n    cmd: python typo.py\n")
    (tmp_path / "chatty.py").write_text(CHATTY_PY)
    (tmp_path / "typo.py").write_text(TYPO_PY)

    # the stage's own lines reach the task's log: each step, the bar's last frame, the rate-limit note
    capsys.readouterr()
    state = dare_pipeline(stages=["chatty"], repo=str(tmp_path), return_state=True)
    # ... and the console once: echoed live, not again by Prefect's console handler
    console = capsys.readouterr()
    assert (console.out + console.err).count("step 1 loss 3.000") == 1, console.err[-2000:]
    logs, _ = _task_logs(state.state_details.flow_run_id)
    chatty = logs["chatty"]
    assert {"step 1 loss 3.000", "step 3 loss 1.000", "sampling 200/200"} <= set(chatty)
    assert not any(m.startswith("sampling 57/200") for m in chatty)  # no intermediate redraws
    assert any(m.endswith("lines not forwarded (more than 10/s; the worker's console has them)") for m in chatty)
    assert sum(m.startswith("noise") for m in chatty) < 100

    # a failed stage: the task's (and the exception's) message is the worker's own error line
    worker_line = "error: params.yaml: unknown config key 'sft.max_step' (did you mean 'max_steps'?)"
    state = dare_pipeline(stages=["typo"], repo=str(tmp_path), retries=0, return_state=True)
    with pytest.raises(StageFailed) as err:
        state.result()
    assert str(err.value).startswith(worker_line) and err.value.returncode == 2
    logs, messages = _task_logs(state.state_details.flow_run_id, levels=True)
    assert worker_line in messages["typo"] and (logging.ERROR, worker_line) in logs["typo"]
    # the reason is an error in the task's log (what the UI's level filter shows), not only Prefect's
    # "Retries are exhausted"; the stage's ordinary lines stay at INFO
    assert [m for level, m in logs["typo"] if level == logging.ERROR and m.startswith("stage typo failed (attempt 1): "
                                                                                       + worker_line)]
    assert (logging.INFO, "loading params.yaml") in logs["typo"]

    # eval publishes its table only from the run that evaluated: a run that skips eval adds no version
    dare_pipeline(repo=str(tmp_path), retry_delay_seconds=0)
    versions = _artifact_versions("dare-eval-table")
    dare_pipeline(stages=["sft", "eval"], repo=str(tmp_path))
    assert _artifact_versions("dare-eval-table") == versions

    # overrides: params.yaml keys set for the run, tracked by DVC (rl reruns), recorded in dare-run
    res = dare_pipeline(stages=["rl"], repo=str(tmp_path), overrides=["rl.lr=0.3"])
    assert res.ran == ["rl"] and "lr: 0.3" in (tmp_path / "params.yaml").read_text()
    assert "`rl.lr=0.3`" in Artifact.get("dare-run").data
    with pytest.raises(ValueError, match=r"has no key 'l' under rl \(did you mean 'lr'\?\)"):
        dare_pipeline(stages=["rl"], repo=str(tmp_path), overrides=["rl.l=0.3"])

    # isolated: a git worktree of the commit; the checkout is left exactly as it was
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    with open(tmp_path / ".gitignore", "a") as f:  # DVC lists the outputs there
        f.write(".convert_failed_once\nlog.txt\n")
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "project"], cwd=tmp_path, check=True)
    before = subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True).stdout
    res = dare_pipeline(stages=["prepare", "sft", "rl"], repo=str(tmp_path), overrides=["rl.lr=0.1"], isolated=True)
    work = Path(res.repo)
    assert work.parent == tmp_path / ".cache" / "workspaces" and (work / "rl.out").exists()
    assert "lr: 0.1" in (work / "params.yaml").read_text() and "lr: 0.3" in (tmp_path / "params.yaml").read_text()
    assert subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True).stdout == before
    assert "isolated git worktree" in Artifact.get("dare-run").data
    assert '"status": "ran"' in (work / ".dare-run.json").read_text()  # its outcome, for the prune
    # the workspace has no outputs: DVC checks them out of the shared cache (prepare and sft as in
    # the committed dvc.lock, rl from its run cache: lr 0.1 ran earlier) and runs no cmd (no log.txt)
    assert res.restored == ["prepare", "sft", "rl"] and res.ran == res.skipped == [] and not (work / "log.txt").exists()
    assert [row["status"] for row in json.loads(Artifact.get("dare-stages").data)] == ["restored"] * 3
