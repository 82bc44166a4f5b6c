"""`dare eval` labels: a checkpoint's stage, else its folder's name, unless --name (dare_core/eval/labels.py)."""
import re
from pathlib import Path

import pytest

from dare_core.cli import build_parser, main
from dare_core.config import DareConfig, RunConfig
from dare_core.errors import UserError
from dare_core.eval.labels import checkpoint_labels, stage_of


@pytest.fixture
def project(tmp_path):
    """A project layout whose run 'exp' and an older run 'old' both went through every stage."""
    for run in ("exp", "old"):
        for sub in ("base", "sft/model", "preference/model", "rl/checkpoints"):
            (tmp_path / "runs" / run / sub).mkdir(parents=True)
        (tmp_path / "models" / run).mkdir(parents=True)
    (tmp_path / "models" / "LLaDA-8B-Instruct").mkdir()  # downloaded, not trained here
    cfg = DareConfig(run=RunConfig(name="exp", runs_dir=str(tmp_path / "runs"), models_dir=str(tmp_path / "models")))
    return tmp_path, cfg


def test_stage_outputs_are_labelled_by_stage(project):
    root, cfg = project
    for run in ("exp", "old"):  # this run's checkpoints and another run's in the same places
        assert stage_of(root / "runs" / run / "base", cfg) == "base"
        assert stage_of(root / "runs" / run / "sft" / "model", cfg) == "sft"
        assert stage_of(str(root / "runs" / run / "preference" / "model") + "/", cfg) == "preference"
        assert stage_of(root / "models" / run, cfg) == "rl"
    assert stage_of(root / "models" / "LLaDA-8B-Instruct", cfg) is None  # models/ without an RL run of that name
    assert stage_of(root / "runs" / "exp" / "sft", cfg) is None
    cfg.model.path = str(root / "models" / "LLaDA-8B-Instruct")  # the run started from it: its base
    assert stage_of(root / "models" / "LLaDA-8B-Instruct", cfg) == "base"


def test_labels_stage_then_folder_name_and_names_override(project):
    root, cfg = project
    folders = [str(root / "runs/exp/base"), str(root / "runs/exp/sft/model"), str(root / "models/exp"),
               str(root / "models/LLaDA-8B-Instruct")]
    labels = checkpoint_labels(folders, None, cfg)
    assert list(labels) == ["base", "sft", "rl", "LLaDA-8B-Instruct"]  # in the order given
    assert labels["sft"] == Path(folders[1])
    named = checkpoint_labels(folders[:2], ["untrained", "sft-3k"], cfg)
    assert named == {"untrained": Path(folders[0]), "sft-3k": Path(folders[1])}


def test_duplicate_and_bad_labels_are_errors(project):
    root, cfg = project
    a, b = str(root / "runs/exp/sft/model"), str(root / "runs/old/sft/model")
    with pytest.raises(UserError, match=re.escape(f"--model {a} and --model {b} would both be labelled 'sft'")):
        checkpoint_labels([a, b], None, cfg)
    with pytest.raises(UserError, match="would both be labelled 'x'"):
        checkpoint_labels([a, b], ["x", "x"], cfg)
    with pytest.raises(UserError, match=r"--name given 1 time\(s\) for 2 --model"):
        checkpoint_labels([a, b], ["x"], cfg)
    for bad in ("", "a/b", "a|b", ".."):
        with pytest.raises(UserError, match="--name"):
            checkpoint_labels([a], [bad], cfg)


def test_eval_parses_one_name_per_model():
    args = build_parser().parse_args(["eval", "--model", "runs/a/sft/model", "--name", "a", "--model", "models/b", "--name", "b"])
    assert args.model == ["runs/a/sft/model", "models/b"] and args.name == ["a", "b"] and args.params is None
    args = build_parser().parse_args(["eval", "--model", "m"])
    assert args.name is None


def test_eval_refuses_duplicate_labels_before_running(project, tmp_path, capsys):
    root, _ = project
    params = root / "params.yaml"
    params.write_text(f"run: {{name: exp, runs_dir: {root / 'runs'}, models_dir: {root / 'models'}}}\n")
    work = tmp_path / "work"
    assert main(["eval", "--params", str(params), "--model", str(root / "runs/exp/sft/model"),
                 "--model", str(root / "runs/old/sft/model"), "--work-dir", str(work)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "labelled 'sft'" in err and "runs/old/sft/model" in err
    assert not work.exists()
