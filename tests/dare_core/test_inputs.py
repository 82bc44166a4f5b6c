"""The record of the input files' content that DVC compares (dare_core/inputs.py): a local file by
its hash, a user reward by its module's source, found without running it."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from dare_core.config import DareConfig
from dare_core.errors import UserError
from dare_core.inputs import identities, module_source, reward_identity
from pipeline_helpers import REPO


def test_files_are_named_by_their_content(tmp_path):
    cfg = DareConfig()
    source = tmp_path / "train.jsonl"
    source.write_text('{"prompt": "a", "response": "b", "ground_truth": "b"}\n')
    cfg.data.source = str(source)
    found = identities(cfg)
    assert found["data.source"] == {"path": str(source), "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    assert found["data.eval_source"] is None and found["rl.reward"] is None  # unset; a built-in reward
    source.write_text(source.read_text().replace('"b"', '"c"'))  # the same path, edited in place
    assert identities(cfg)["data.source"]["sha256"] != found["data.source"]["sha256"]
    cfg.data.eval_source = str(tmp_path / "gone.jsonl")
    with pytest.raises(UserError, match=r"data.eval_source: .*gone.jsonl is not a file"):
        identities(cfg)


def test_a_user_reward_module_is_hashed_without_being_imported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "pkg" / "grade.py").write_text("raise SystemExit('imported')\ndef score(c, g, r): return 1.0\n")
    found = reward_identity("pkg.grade:score")
    assert found["file"] == str(tmp_path / "pkg" / "grade.py")
    assert found["sha256"] == hashlib.sha256((tmp_path / "pkg" / "grade.py").read_bytes()).hexdigest()
    assert "pkg.grade" not in sys.modules
    assert module_source("pkg", [str(tmp_path)]) == tmp_path / "pkg" / "__init__.py"
    assert reward_identity("nowhere_to_be_found:score") == {"module": "nowhere_to_be_found", "file": None}


def test_the_stage_writes_the_record(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    done = subprocess.run([sys.executable, "-m", "dare_core.workers.inputs", "--params", str(params),
                           "-S", f"run.metrics_dir={tmp_path / 'metrics'}"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "metrics" / "inputs.json").read_text())
    assert set(record) == {"data.source", "data.eval_source", "data.val_source", "data.preference_source", "rl.reward"}
    # DVC runs it on every `dvc repro`: it must not pay for torch's import
    probe = "import sys, dare_core.workers.inputs; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"
