"""The Prefect pipeline flow against a throwaway DVC repo: real Prefect (ephemeral), real DVC.

One test on purpose: Prefect's ephemeral server takes ~20 s to start on a fresh PREFECT_HOME, once
per process; every flow run after that costs about a second.
"""

from __future__ import annotations

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


@pytest.fixture
def prefect_env(tmp_path_factory):
    """Hermetic ephemeral Prefect: fresh PREFECT_HOME, no server URL, generous startup timeout."""
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
