"""The record of the input files' content that DVC compares (dare_core/inputs.py): a local file by
its hash, a user reward by its module's source, found without running it."""
from __future__ import annotations

import hashlib
import os
import json
from pathlib import Path
import subprocess
import sys

import pytest

from dare_core.config import DareConfig
from dare_core.errors import UserError
from dare_core.inputs import identities, module_source, project_sources, reward_identity, reward_inputs
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
    assert found["file"] == "pkg/grade.py"  # relative to the project: the record reads the same in every clone
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


def test_the_project_modules_a_reward_imports_are_its_sources(tmp_path, monkeypatch):
    """Whatever the reward module imports from the project, by any import form and transitively, is
    part of its identity; the standard library, installed packages and DARE are not; nothing runs."""
    monkeypatch.chdir(tmp_path)
    stop = "raise SystemExit('imported')\n"
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text(stop)
    (tmp_path / "pkg" / "grade.py").write_text(stop + "import json, torch\nimport helpers\nfrom . import norms\n"
                                               "from .sub.deep import x\nfrom dare_core.rewards import math\n")
    (tmp_path / "pkg" / "norms.py").write_text(stop + "from .sub import tables\n")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text(stop)
    (tmp_path / "pkg" / "sub" / "deep.py").write_text(stop + "x = 1\n")
    (tmp_path / "pkg" / "sub" / "tables.py").write_text(stop)
    (tmp_path / "helpers.py").write_text(stop + "from pkg.sub import deep\nimport broken\n")
    (tmp_path / "broken.py").write_text("def (:\n")  # does not parse: hashed, imports nothing here
    (tmp_path / "unused.py").write_text(stop)
    found = project_sources("pkg.grade", tmp_path)
    assert list(found)[0] == "pkg.grade"
    assert set(found) == {"pkg.grade", "pkg", "helpers", "pkg.norms", "pkg.sub", "pkg.sub.deep", "pkg.sub.tables", "broken"}
    assert "pkg" not in sys.modules and "helpers" not in sys.modules
    record = reward_identity("pkg.grade:score")
    assert set(record["imports"]) == {"pkg/__init__.py", "helpers.py", "pkg/norms.py", "pkg/sub/__init__.py",
                                      "pkg/sub/deep.py", "pkg/sub/tables.py", "broken.py"}
    (tmp_path / "pkg" / "sub" / "tables.py").write_text(stop + "# an edit two imports away\n")
    again = reward_identity("pkg.grade:score")
    assert again["sha256"] == record["sha256"] and again["imports"] != record["imports"]
    roles = reward_inputs("pkg.grade:score")
    assert roles["reward module pkg.sub.tables"] == Path("pkg/sub/tables.py") and len(roles) == 8
    assert reward_inputs("exact_match") == {}


def test_files_in_the_project_are_recorded_relative_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    cfg = DareConfig()
    cfg.data.source = str(tmp_path / "data" / "train.jsonl")  # given absolute
    assert identities(cfg)["data.source"]["path"] == "data/train.jsonl"


def test_dvc_status_names_an_edited_input_file(tmp_path):
    """The inputs stage lists the project files the settings name (data/input_files.yaml); dvc.yaml
    makes a stage depend on each, so `dvc status` sees a data or reward edit before anything runs."""
    from pipeline_helpers import copy_pipeline

    copy_pipeline(tmp_path)
    (tmp_path / "data" / "own").mkdir(parents=True)
    train = tmp_path / "data" / "own" / "train.jsonl"
    # (data prepare accepts: the inputs stage makes prepare's checks before it records anything)
    train.write_text("".join(json.dumps({"prompt": p, "response": "b", "ground_truth": "b"}) + "\n" for p in "acdefgh"))
    (tmp_path / "own_reward.py").write_text("from helpers import norm\ndef score(c, g, r): return float(norm(c) == g)\n")
    (tmp_path / "helpers.py").write_text("def norm(text): return text.strip()\n")
    outside = tmp_path.parent / f"{tmp_path.name}-eval.jsonl"  # outside the project: inputs.json only
    outside.write_text(train.read_text())
    params = (REPO / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(params)
    settings = ["data.source=data/own/train.jsonl", f"data.eval_source={outside}", "rl.reward=own_reward:score",
                "data.num_sft=4", "data.num_rl=4", "data.num_val=2", "data.num_preference=0"]
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, env=env, capture_output=True)
    done = subprocess.run([sys.executable, "-m", "dare_core.workers.inputs", "--params", "params.yaml",
                           *[a for s in settings for a in ("-S", s)]], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    import yaml

    listed = yaml.safe_load((tmp_path / "data" / "input_files.yaml").read_text())["input_files"]
    assert listed == ["data/own/train.jsonl", "helpers.py", "own_reward.py"]

    def status() -> set:
        out = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return {name for name in json.loads(out.stdout.strip().splitlines()[-1]) if name.startswith("input_file@")}

    ran = subprocess.run([sys.executable, "-m", "dvc", "repro", "input_file"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert status() == set()
    train.write_text(train.read_text() + '{"prompt": "i", "response": "d", "ground_truth": "d"}\n')
    assert status() == {"input_file@data/own/train.jsonl"}
    (tmp_path / "helpers.py").write_text("def norm(text): return text.strip().lower()\n")
    assert status() == {"input_file@data/own/train.jsonl", "input_file@helpers.py"}


def test_a_stage_ends_with_its_wall_time(tmp_path):
    """`dare stage <name>`'s last line on success: how long it took (what a `dvc repro` log shows)."""
    import re

    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    done = subprocess.run([sys.executable, "-m", "dare_core.cli", "stage", "inputs", "--params", str(params),
                           "-S", f"run.metrics_dir={tmp_path / 'metrics'}"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"dare stage inputs: done in \d+\.\d s", done.stdout.strip().splitlines()[-1]), done.stdout
    from dare_core.cli import _duration

    assert (_duration(3.04), _duration(265.4), _duration(3725)) == ("3.0 s", "4 min 25 s", "1 h 02 min 05 s")
