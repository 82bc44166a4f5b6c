"""Bad input, third round (held-out cases that got through): a key given twice in a settings file or
in a JSON-lines row, an empty test or validation file, a row nested past any use, `dare stage` typed
in a subfolder, and settings a later stage refuses: refused by the inputs stage, the first one
`dvc repro` runs, before DVC removes prepare's outputs.

Most checks call the validating functions in this process; the few `dare` (and one `dvc repro`)
runs reuse the tiny project of tests/bad_input.py (`project`) and assert its watched folders are
untouched.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bad_input import assert_clean_failure, run, snapshot
from pipeline_helpers import REPO, copy_pipeline, worker_env


def _rows(n: int = 30) -> list[str]:
    return [json.dumps({"prompt": f"{i}+{i}=", "response": str(2 * i), "ground_truth": str(2 * i)}) for i in range(n)]


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# --------------------------------------------------------------------------- a key given twice (YAML)

PARAMS = """\
run:
  name: t
data:
  num_sft: 10
  task_args:
    min_digits: 1
    max_digits: 2
  num_rl: 10
  task_args:
    min_digits: 2
"""


def test_a_key_twice_in_params_yaml_is_refused_naming_its_second_line_and_dotted_key(tmp_path: Path) -> None:
    from dare_core.config import ConfigError, load_config

    params = tmp_path / "params.yaml"
    params.write_text(PARAMS)
    with pytest.raises(ConfigError) as caught:
        load_config(params)
    assert str(caught.value).startswith(f"{params}: line 9: duplicate key 'data.task_args' (first at line 5)")
    # one level down, and in a list
    params.write_text(PARAMS.replace("  num_rl: 10\n  task_args:\n    min_digits: 2\n", "    min_digits: 3\n"))
    with pytest.raises(ConfigError, match=r"line 8: duplicate key 'data.task_args.min_digits' \(first at line 6\)"):
        load_config(params)
    params.write_text("run: {name: t}\neval:\n  benchmark_args: {task: {sampler: [{a: 1}, {a: 2, a: 3}]}}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'eval.benchmark_args.task.sampler\[1\].a'"):
        load_config(params)
    # a key a YAML merge brought in may still be given: that is what `<<` is for
    params.write_text("run: {name: t}\nrl:\n  sampler: &s {temperature: 0.5, batch_size: 4}\n"
                      "eval:\n  sampler:\n    <<: *s\n    batch_size: 8\n")
    assert (load_config(params).eval.sampler.temperature, load_config(params).eval.sampler.batch_size) == (0.5, 8)


def test_a_key_twice_in_a_recipe_or_an_override_is_refused(tmp_path: Path) -> None:
    from dare_core.config import ConfigError, load_config
    from dare_core.recipes import RecipeError
    from tasks.workspace import parse_overrides

    params = tmp_path / "params.yaml"
    params.write_text("run: {name: t}\n")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("rl:\n  num_steps: 5\n  kl_beta: 0.1\n  num_steps: 7\n")
    with pytest.raises(RecipeError, match=rf"{recipe}: line 4: duplicate key 'rl.num_steps' \(first at line 2\)"):
        load_config(params, [f"recipe={recipe}"])
    with pytest.raises(ConfigError, match=r"override 'rl.reward_args=\{a: 1, a: 2\}': .*duplicate key 'rl.reward_args.a'"):
        load_config(params, ["rl.reward_args={a: 1, a: 2}"])
    with pytest.raises(ValueError, match=r"duplicate key 'rl.reward_args.a'"):  # the flow's --set
        parse_overrides(["rl.reward_args={a: 1, a: 2}"])


def test_dare_stage_refuses_a_params_key_given_twice(project: Path) -> None:
    params = project / "params.yaml"
    lines = params.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("  num_sft:"))
    params.write_text("".join(lines[:at + 1] + ["  num_sft: 7\n"] + lines[at + 1:]))
    before = snapshot(project)
    result = run(project, "stage", "prepare")
    line = assert_clean_failure(result, ("params.yaml", f"line {at + 2}", "'data.num_sft'"), before, project)
    assert result.returncode == 2, line


# --------------------------------------------------------------------------- JSON-lines rows


def test_a_key_twice_in_a_row_is_refused_naming_file_line_and_key(tmp_path: Path) -> None:
    from dare_core.data.schema import DataError, read_rows

    rows = _rows()
    rows[3] = rows[3][:-1] + ', "prompt": "x"}'
    rows[8] = rows[8][:-1] + ', "meta": {"id": 1, "id": 2}}'
    source = _write_lines(tmp_path / "raw.jsonl", rows)
    with pytest.raises(DataError, match=r"raw.jsonl: line 4: key 'prompt' appears twice"):
        read_rows(source, "source")
    rows[3] = _rows()[3]
    _write_lines(source, rows)
    with pytest.raises(DataError, match=r"raw.jsonl: line 9: key 'id' appears twice"):  # nested too
        read_rows(source, "source")


@pytest.mark.parametrize("depth", [150, 100_000])
def test_a_row_nested_past_the_limit_is_refused_in_one_line(tmp_path: Path, depth: int) -> None:
    """100 000 levels made json's parser end in a RecursionError (58 lines of traceback); 150 parse,
    but no column nests at all."""
    from dare_core.data.schema import MAX_NESTING, DataError, read_rows

    rows = _rows()
    rows[4] = rows[4][:-1] + ', "meta": ' + "[" * depth + "]" * depth + "}"
    source = _write_lines(tmp_path / "raw.jsonl", rows)
    with pytest.raises(DataError) as caught:
        read_rows(source, "source")
    assert str(caught.value) == f"{source}: line 5: nested deeper than {MAX_NESTING} levels"
    allowed = MAX_NESTING - 1  # (the row's own object is the first level)
    rows[4] = _rows()[4][:-1] + ', "meta": ' + "[" * allowed + "]" * allowed + "}"
    _write_lines(source, rows)
    assert len(read_rows(source, "source")) == 30


# --------------------------------------------------------------------------- an empty test or validation file


@pytest.mark.parametrize("setting", ["val_source", "eval_source"])
def test_an_empty_test_or_validation_file_is_refused_as_an_empty_training_file_is(tmp_path: Path, setting: str) -> None:
    from dare_core.config import DareConfig
    from dare_core.data.prepare import prepare
    from dare_core.data.schema import DataError

    cfg = DareConfig()
    cfg.data.prepared_dir, cfg.data.tokenizer_dir = str(tmp_path / "prepared"), str(tmp_path / "tokenizer")
    cfg.data.source = str(_write_lines(tmp_path / "raw.jsonl", _rows()))
    cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval, cfg.data.num_val, cfg.data.num_preference = 10, 10, 4, 2, 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")  # blank lines only: no rows
    setattr(cfg.data, setting, str(empty))
    with pytest.raises(DataError) as caught:
        prepare(cfg)
    assert str(caught.value).startswith(f"{empty}: no rows (data.{setting})"), caught.value
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "tokenizer").exists()


# --------------------------------------------------------------------------- typed in a subfolder


def test_the_project_root_is_the_nearest_folder_holding_params_or_dvc_yaml(tmp_path: Path) -> None:
    from dare_core.process.env_file import project_root

    (tmp_path / "proj" / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "proj" / "params.yaml").write_text("run: {}\n")
    assert project_root(tmp_path / "proj" / "sub" / "deeper") == (tmp_path / "proj").resolve()
    (tmp_path / "proj" / "sub" / "dvc.yaml").write_text("stages: {}\n")  # a project of its own
    assert project_root(tmp_path / "proj" / "sub" / "deeper") == (tmp_path / "proj" / "sub").resolve()
    (tmp_path / "alone").mkdir()
    assert project_root(tmp_path / "alone") == (tmp_path / "alone").resolve()


def test_dare_stage_in_a_subfolder_writes_in_the_project_root(project: Path) -> None:
    sub = project / "notebooks"
    sub.mkdir()
    (project / "metrics" / "inputs.json").unlink(missing_ok=True)
    for args in ((), ("--params", "../params.yaml")):
        done = subprocess.run([sys.executable, "-m", "dare_core.cli", "stage", "inputs", *args], cwd=sub,
                              env=worker_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"working in the project root {project.resolve()}" in done.stdout
        assert (project / "metrics" / "inputs.json").is_file()
        assert not any(sub.iterdir()), sorted(p.name for p in sub.iterdir())  # no sub/metrics, sub/data


# --------------------------------------------------------------------------- refused by the first stage


@pytest.mark.parametrize("override, culprit", [
    ("model.init.n_layerz=2", "model.init.n_layerz"),  # read by prepare and sft
    ("model.init.n_kv_heads=3", "n_kv_heads (3) must divide n_heads (2)"),
    ("rl.algorithm_args={d1: {p_mask_promt: 0}}", "rl.algorithm_args.d1.p_mask_promt"),
    ("rl.algorithm=nope", "unknown algorithm 'nope'"),
    ("rl.sampler.cache=block_kv", "rl.sampler.cache"),
    ("rl.sampler.engine=vllm", "unknown rollout engine 'vllm'"),
    ("model.lora={r: 4, alpha: 8, dropout: 0.1}", "model.lora.dropout: 0"),
    ("preference.algorithm=dpo", "preference.algorithm"),
    ("eval.benchmarks=[gsm9k]", "eval.benchmarks"),
    ("eval.benchmark_args={task: {mode: ll}}", "mode 'll' not available"),
])
def test_settings_a_later_stage_refuses_are_refused_by_the_inputs_stages_checks(
        project: Path, monkeypatch: pytest.MonkeyPatch, override: str, culprit: str) -> None:
    from dare_core.config import load_config
    from dare_core.workers.settings_checks import check_settings

    monkeypatch.chdir(project)
    cfg = load_config("params.yaml", [override])  # the settings file itself reads fine
    before = snapshot(project)
    with pytest.raises(ValueError) as caught:
        check_settings(cfg)
    assert culprit in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert snapshot(project) == before
    check_settings(load_config("params.yaml"))  # the project's own settings pass


def test_the_inputs_stage_refuses_a_model_init_typo(project: Path) -> None:
    before = snapshot(project)
    result = run(project, "stage", "inputs", "-S", "model.init.n_layerz=2")
    line = assert_clean_failure(result, "model.init.n_layerz", before, project)
    assert result.returncode == 2, line


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**worker_env(), "DVC_NO_ANALYTICS": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)


def test_dvc_repro_keeps_prepares_outputs_when_prepare_would_refuse(project: Path) -> None:
    """DVC removes a stage's outputs before it runs the stage: a prepare refusing a bad row lost
    data/prepared and the tokenizer. The inputs stage, which DVC runs first, refuses it now."""
    copy_pipeline(project)
    (project / ".dvc").mkdir()
    (project / ".dvc" / "config").write_text("[core]\n    no_scm = True\n")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "dare_core", project / "dare_core", ignore=ignore)  # dvc.yaml's code deps
    shutil.copytree(REPO / "configs" / "recipes", project / "configs" / "recipes")
    first = _dvc(project, "repro", "prepare")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    prepared = {k: v for k, v in snapshot(project).items() if k.startswith(("data/prepared", "data/tokenizer"))}
    assert "data/prepared/sft.parquet" in prepared and "data/tokenizer" in prepared
    rows = _rows()
    rows[2] = rows[2][:-1] + ', "ground_truth": "4"}'  # a key given twice: prepare refuses the file
    _write_lines(project / "raw.jsonl", rows)
    params = project / "params.yaml"
    params.write_text(params.read_text().replace("  source: null\n", "  source: raw.jsonl\n"))
    before = snapshot(project)
    second = _dvc(project, "repro", "prepare")
    assert second.returncode != 0
    assert "raw.jsonl: line 3: key 'ground_truth' appears twice" in second.stdout + second.stderr
    after = snapshot(project)
    assert {k: v for k, v in after.items() if k in prepared} == prepared and after == before
