"""params.yaml survives `dvc exp run -S` (and the flow's `overrides`) line for line: only the set keys change.

DVC rewrites params.yaml through ruamel's round trip, which re-wraps long flow mappings at 80
columns, turns some flow lists into block lists and writes null as an empty value. params.yaml is
kept in the form that round trip reproduces, so an experiment's diff is the keys it set.
"""
from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def changed_lines(before: str, after: str) -> list[str]:
    return [ln for ln in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def test_params_yaml_is_a_fixed_point_of_dvcs_yaml_round_trip():
    from dvc.utils.serialize._yaml import dumps_yaml, parse_yaml_for_update

    text = (REPO / "params.yaml").read_text()
    assert dumps_yaml(parse_yaml_for_update(text, "params.yaml")) == text


def test_dvc_exp_run_set_param_changes_only_the_set_lines(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "dvc.yaml").write_text("stages:\n  s:\n    cmd: echo ok > o.txt\n    params: [run.seed, model.path, rl.sampler.steps]\n"
                                       "    outs: [o.txt]\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"], ["git", "add", "-A"],
                [*git, "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    before = (tmp_path / "params.yaml").read_text()
    run = subprocess.run([sys.executable, "-m", "dvc", "exp", "run", "-S", "run.seed=3", "-S", "model.path=/models/llada",
                          "-S", "rl.sampler.steps=3"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    after = (tmp_path / "params.yaml").read_text()
    assert len(changed_lines(before, after)) == 6, "\n".join(changed_lines(before, after))
    assert "  seed: 3" in after and "  path: /models/llada " in after and "    steps: 3" in after
    assert yaml.safe_load(after)["eval"] == yaml.safe_load(before)["eval"]


def test_flow_overrides_change_only_their_lines(tmp_path):
    sys.path.insert(0, str(REPO))
    from tasks.workspace import apply_overrides

    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    before = params.read_text()
    apply_overrides(params, ["rl.num_steps=200", "recipe=d1", "eval.checkpoints=[sft, rl]"])
    after = params.read_text()
    assert yaml.safe_load(after)["rl"]["num_steps"] == 200 and yaml.safe_load(after)["recipe"] == "d1"
    changes = changed_lines(before, after)
    added = [ln for ln in changes if ln.startswith("+")]
    assert [ln for ln in changes if ln.startswith("-")] == ["-recipe:             # empty: none (an empty value is null; DVC's -S writes nulls this way too)",
                                                           "-  num_steps: 100", "-  - base"]
    assert len(added) == 2 and added[1] == "+  num_steps: 200"
    assert added[0].startswith("+recipe: d1 ") and added[0].endswith("# empty: none (an empty value is null; DVC's -S writes nulls this way too)")


def test_an_override_points_the_inputs_at_object_storage(tmp_path):
    sys.path.insert(0, str(REPO))
    from dare_core.config import load_config
    from tasks.workspace import apply_overrides

    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    before = params.read_text()
    apply_overrides(params, ["data.source=s3://bucket/key.jsonl", "data.eval_source=s3://bucket/test.jsonl",
                             "model.path=s3://bucket/models/llada"])
    cfg = load_config(params)
    assert (cfg.data.source, cfg.data.eval_source, cfg.model.path) == \
        ("s3://bucket/key.jsonl", "s3://bucket/test.jsonl", "s3://bucket/models/llada")
    changes = changed_lines(before, params.read_text())
    assert len(changes) == 6 and "+  source: s3://bucket/key.jsonl " in "\n".join(changes), "\n".join(changes)
