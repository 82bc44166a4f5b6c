"""A stage killed by a signal fails with the signal's name, through a real `dvc repro`."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

from tasks.dvc_stage import StageFailed, run_stage

REPO = Path(__file__).resolve().parents[2]
BAR = r"printf 'sft:  40%%|####      | 4/10 [00:01<00:02, 3.21it/s]\r'"
KILLED = "['sh', '-c', 'kill -KILL $$']"
SCRIPTS = {
    # what `dare stage` did before it named the signal itself: sys.exit(-9), which DVC sees as 247
    "relay.py": f"import subprocess, sys\nsys.exit(subprocess.call({KILLED}))\n",
    # `dare stage`'s launch of a worker, the worker killed
    "launch.py": f"import os, sys\nfrom dare_core.cli import _launch\nsys.exit(_launch({KILLED}, dict(os.environ)))\n",
}
STAGES = {"killed": f"{BAR}; kill -KILL $$", "relayed": f"{BAR}; python relay.py", "dare": f"{BAR}; python launch.py"}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A DVC project (no git) whose stages end killed."""
    root = tmp_path_factory.mktemp("killed")
    (root / ".dvc").mkdir()
    (root / ".dvc" / "config").write_text("[core]\n    no_scm = True\n")
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {name: {"cmd": cmd} for name, cmd in STAGES.items()}}))
    for name, text in SCRIPTS.items():
        (root / name).write_text(text)
    return root


def failure(project: Path, stage: str) -> StageFailed:
    # `python` in a cmd is this interpreter (stage_env puts its bin first on PATH); dare_core this checkout's
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with pytest.raises(StageFailed) as err:
        run_stage(stage, project, force=True, env={**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"})
    return err.value


@pytest.mark.parametrize("stage, code", [("killed", -9), ("relayed", 247)])
def test_a_killed_stage_is_named_killed_by_its_signal_not_by_its_last_bar(project, stage, code):
    err = failure(project, stage)
    assert (err.returncode, err.signal) == (code, signal.SIGKILL)
    assert str(err) == f"stage {stage!r} was killed by SIGKILL (out of memory? see dmesg)"


def test_dare_stage_s_own_line_for_a_killed_worker_leads(project):
    err = failure(project, "dare")
    assert err.returncode == 137 and err.signal is signal.SIGKILL
    assert str(err).startswith("error: the worker (pid ")
    assert str(err).endswith(" was killed by SIGKILL (out of memory? see dmesg) [stage 'dare' failed with exit code 137]")


def test_stages_get_dare_env_where_the_environment_lacks_it(monkeypatch):
    from tasks.dvc_stage import stage_env

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user's choice
    env = stage_env(REPO)
    assert env["TORCH_EXTENSIONS_DIR"] == str(REPO / ".cache" / "torch_extensions") and env["HF_HUB_OFFLINE"] == "0"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere/ops")
    assert stage_env(REPO)["TORCH_EXTENSIONS_DIR"] == "/elsewhere/ops"
