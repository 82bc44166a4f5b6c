"""dare.env, the one list of DARE's runtime environment: make, `dare stage` and the stage tasks
read the same values from it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dare_core.process.env_file import ENV_FILE, env_defaults, read_env_file
from dare_core.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def test_the_file_puts_deepspeeds_ops_in_the_projects_cache():
    values = read_env_file(REPO / ENV_FILE)
    assert values["TORCH_EXTENSIONS_DIR"] == str(REPO / ".cache" / "torch_extensions")
    assert values["PREFECT_HOME"] == str(REPO / ".cache" / "prefect")
    assert values["HF_HUB_OFFLINE"] == "1" and values["DVC_NO_ANALYTICS"] == "1"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_exports_the_same_values_to_every_target():
    values = env_defaults(REPO)
    clean = {k: v for k, v in os.environ.items() if k not in values and not k.startswith("MAKE")}
    out = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", "--eval", "dare-env: ; @env", "dare-env"],
                         cwd=REPO, env=clean, capture_output=True, text=True, check=True).stdout
    made = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {k: made.get(k) for k in values} == values  # DS_ACCELERATOR=cpu too, on a machine without nvidia-smi


def test_a_workspace_shares_its_checkouts_cache(tmp_path):
    project = tmp_path / "project"
    workspace = project / ".cache" / "workspaces" / "run-1"
    workspace.mkdir(parents=True)
    shutil.copy(REPO / ENV_FILE, project / ENV_FILE)
    shutil.copy(REPO / ENV_FILE, workspace / ENV_FILE)
    expected = str(project.resolve() / ".cache" / "torch_extensions")
    assert read_env_file(workspace / ENV_FILE)["TORCH_EXTENSIONS_DIR"] == expected
    assert env_defaults(workspace)["TORCH_EXTENSIONS_DIR"] == expected
    assert env_defaults(tmp_path)["TORCH_EXTENSIONS_DIR"] == str(REPO / ".cache" / "torch_extensions")  # no file: the code's


@pytest.mark.parametrize("line", ["HOME_DIR='/x'", "A=1 # note", "B=$HOME/x", "not a line", "C=${PROJECT}/x"])
def test_lines_both_readers_would_take_differently_are_refused(tmp_path, line):
    path = tmp_path / ENV_FILE
    path.write_text(f"# fine\nOK=1\n\n{line}\n")
    with pytest.raises(UserError, match=r"dare.env:4: expected KEY=value .*got " + re.escape(repr(line))):
        read_env_file(path)
