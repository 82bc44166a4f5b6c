"""No setting deletes a user's data (issue 29): output locations are checked as one set when the
config is loaded, a stage replaces only folders DARE wrote (the `.dare-output` marker), an empty
params file is refused, `model.init` typos are named, and `packing: on/off` reads as documented.

Most cases call the checks in process on a small project folder of stand-in files; two run
`dare stage` end to end and assert one `error:` line, exit code 2, and every file of the project
byte-identical (tests/bad_input.py's checks, over the whole project folder).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from bad_input import run
from dare_core.config import ConfigError, load_config
from dare_core.errors import UserError
from dare_core.ownership import OUTPUT_MARKER, check_replaceable
from dare_core.storage import atomic_dir
from pipeline_helpers import REPO, tiny_params, write_params


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """A project folder (relative output paths, as in bad_input.build_project) holding stand-ins for
    what a finished run leaves: the run folder's checkpoints, the export, metrics, the user's
    dataset and data/README.md."""
    root = tmp_path / "project"
    root.mkdir()
    params = tiny_params(root)
    params["run"].update(runs_dir="runs", models_dir="models", metrics_dir="metrics")
    params["data"].update(prepared_dir="data/prepared", tokenizer_dir="data/tokenizer")
    write_params(root / "params.yaml", params)
    (root / "dvc.yaml").write_text("stages: {}\n")
    files = {"data/README.md": "# data/\n", "data/mine.jsonl": '{"prompt": "1+1=", "response": "2", "ground_truth": "2"}\n',
             "data/prepared/sft.parquet": "PAR1", "data/tokenizer/tokenizer.json": "{}",
             "runs/t/sft/checkpoints/step00000020/weights.pt": "w", "runs/t/sft/checkpoints/latest": "step00000020",
             "runs/t/sft/model/config.json": "{}", "runs/t/rl/metrics.jsonl": "{}\n", "runs/t/eval/summary.md": "|",
             "models/t/config.json": "{}", "metrics/sft.json": "{}"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `root`, and '<dir>' for every folder."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        state[os.path.relpath(dirpath, root)] = "<dir>"
        for name in filenames:
            path = os.path.join(dirpath, name)
            state[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return state


def _load(root: Path, *overrides: str):
    return load_config(root / "params.yaml", list(overrides), root=root)


# --------------------------------------------------------------------------- output locations as a set

COLLISIONS = [
    # (overrides, what the one line must name)
    (("run.models_dir=runs",), ("run.models_dir's model folder runs/t", "is the same as", "run.runs_dir's run folder runs/t")),
    (("run.models_dir=runs/t/sft",), ("run.runs_dir's sft folder runs/t/sft", "contains", "run.models_dir's model folder runs/t/sft/t")),
    (("data.prepared_dir=data",), ("data.prepared_dir (data)", "contains", "data.tokenizer_dir (data/tokenizer)")),
    (("data.prepared_dir=data", "data.tokenizer_dir=tok"), ("data.prepared_dir (data)", "the input data.source (data/mine.jsonl)")),
    (("data.tokenizer_dir=data/prepared",), ("data.prepared_dir (data/prepared)", "is the same as", "data.tokenizer_dir (data/prepared)")),
    (("run.metrics_dir=runs/t/eval",), ("run.runs_dir's eval folder runs/t/eval", "is the same as", "run.metrics_dir (runs/t/eval)")),
    (("model.path=models/t",), ("run.models_dir's model folder models/t", "the input model.path (models/t)")),
    (("eval.data_dir=runs",), ("run.runs_dir's run folder runs/t", "is inside", "eval.data_dir (runs)")),
    (("run.metrics_dir=.",), ("run.metrics_dir (.)", "the project folder")),
    (("run.name=..",), ("run.runs_dir's run folder runs/..", "the project folder")),
    (("data.prepared_dir=dvc.yaml",), ("data.prepared_dir (dvc.yaml)", "the project's dvc.yaml")),
    (("run.runs_dir=params.yaml",), ("run.runs_dir's run folder params.yaml/t", "is inside", "params.yaml")),
    (("run.artifact_root=runs",), ("run.runs_dir's run folder runs/t", "run.artifact_root's copy of the run runs/t")),
]


@pytest.mark.parametrize("overrides, named", COLLISIONS, ids=[" ".join(c[0]) for c in COLLISIONS])
def test_colliding_outputs_are_refused_naming_both(layout: Path, overrides: tuple, named: tuple) -> None:
    extra = ("data.source=data/mine.jsonl",) if "data.source" in " ".join(named) else ()
    before = tree(layout)
    with pytest.raises(ConfigError) as caught:
        _load(layout, *extra, *overrides)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{layout / 'params.yaml'}: ")
    for text in named:
        assert text in message, message
    assert tree(layout) == before


def test_the_shipped_layouts_pass(layout: Path) -> None:
    """The repository's params.yaml in its own checkout; the test project with a dataset in data/;
    the bench scripts' layout, metrics and models beside the stages' folders in the run folder."""
    assert load_config(REPO / "params.yaml", root=REPO).run.models_dir == "models"
    cfg = _load(layout, "data.source=data/mine.jsonl", "model.path=elsewhere/model", "run.artifact_root=copies")
    assert cfg.data.prepared_dir == "data/prepared"
    assert _load(layout, "run.metrics_dir=runs/t/metrics", "run.models_dir=runs/t/models").run.name == "t"
    # a given model brings its tokenizer: prepare writes none, so data.tokenizer_dir is no output
    # (bench/train_step.py points it at the model folder)
    assert _load(layout, "model.path=elsewhere/model", "data.tokenizer_dir=elsewhere/model").model.path


def test_the_dare_core_package_is_never_an_output(tmp_path: Path) -> None:
    package = Path(__import__("dare_core").__file__).parent
    params = write_params(tmp_path / "params.yaml", tiny_params(tmp_path, run__metrics_dir=str(package / "metrics")))
    with pytest.raises(ConfigError, match=r"run\.metrics_dir .* is inside the dare_core package"):
        load_config(params, root=tmp_path)


STAGE_COLLISIONS = [
    ("convert", ("run.models_dir=runs",), ("run.models_dir's model folder runs/t", "run.runs_dir's run folder runs/t")),
    ("prepare", ("data.prepared_dir=data", "data.tokenizer_dir=tok", "data.source=data/mine.jsonl"),
     ("data.prepared_dir (data) contains the input data.source (data/mine.jsonl)",)),
    ("prepare", ("data.tokenizer_dir=data/prepared",), ("data.prepared_dir (data/prepared)", "data.tokenizer_dir (data/prepared)")),
]


@pytest.mark.parametrize("stage, overrides, named", STAGE_COLLISIONS, ids=["convert-into-runs", "prepared-into-data",
                                                                          "tokenizer-into-prepared"])
def test_dare_stage_refuses_a_collision_with_one_line(layout: Path, monkeypatch, capsys, stage: str, overrides: tuple,
                                                      named: tuple) -> None:
    """`dare stage` in process (the command's own main, from the project folder): exit code 2."""
    from dare_core.cli import main

    monkeypatch.chdir(layout)
    before = tree(layout)
    code = main(["stage", stage, *(a for o in overrides for a in ("-S", o))])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: params.yaml: "), err[-3000:]
    for text in named:
        assert text in lines[0], lines[0]
    assert tree(layout) == before


def test_the_flow_checks_the_config_before_dvc_removes_outputs(layout: Path) -> None:
    """`dvc repro` deletes a stage's outputs before the stage's own checks: the flow loads the
    config first (a pipeline of other commands has none to check)."""
    from flows.pipeline import _check_config

    data = {"prepared_dir": "data", "tokenizer_dir": "tok", "source": "data/mine.jsonl"}
    write_params(layout / "params.yaml", {**tiny_params(layout), "data": data})
    (layout / "dvc.yaml").write_text("stages:\n  other:\n    cmd: echo hi\n")
    _check_config(layout)
    (layout / "dvc.yaml").write_text("stages:\n  prepare:\n    cmd: dare stage prepare\n")
    with pytest.raises(ConfigError, match=r"data\.prepared_dir \(data\) contains the input data\.source"):
        _check_config(layout)


# --------------------------------------------------------------------------- end to end: nothing touched


def _assert_refused(result: subprocess.CompletedProcess, named: tuple, before: dict, root: Path) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    for text in named:
        assert text in lines[0], lines[0]
    assert tree(root) == before


def test_convert_into_the_runs_folder_is_refused_end_to_end(layout: Path) -> None:
    before = tree(layout)
    result = run(layout, "stage", "convert", "-S", "run.models_dir=runs")
    _assert_refused(result, ("run.models_dir's model folder runs/t", "run.runs_dir's run folder runs/t"), before, layout)


def test_prepare_never_replaces_a_folder_of_the_users(layout: Path) -> None:
    """No setting collides (the tokenizer goes elsewhere, data.source is not in data/), but data/
    holds the user's README: prepare refuses to replace the folder, before it writes anything."""
    before = tree(layout)
    result = run(layout, "stage", "prepare", "-S", "data.prepared_dir=data", "-S", "data.tokenizer_dir=tok",
                 "-S", "data.num_sft=10", "-S", "data.num_rl=10", "-S", "data.num_eval=4", "-S", "data.num_val=2",
                 "-S", "data.num_preference=4")
    _assert_refused(result, ("data holds files DARE did not write", "README.md", OUTPUT_MARKER), before, layout)


# --------------------------------------------------------------------------- folders DARE wrote


def test_a_folder_without_the_marker_is_replaced_only_when_it_holds_the_stages_own_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(UserError, match=r"out holds files DARE did not write \(notes\.txt\)"):
        with atomic_dir(out, writes=("config.json",)) as new:
            raise AssertionError("refused before the caller writes")
    # without patterns the check waits for the new folder: what it does not hold again would be lost
    with pytest.raises(UserError, match=r"notes\.txt"):
        with atomic_dir(out) as new:
            (new / "config.json").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert {p.name: p.read_text() for p in out.iterdir()} == {"config.json": "old", "notes.txt": "the user's"}
    # an earlier version's folder (no marker, only the stage's own files) is adopted and marked
    (out / "notes.txt").unlink()
    with atomic_dir(out, writes=("config.json",)) as new:
        (new / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "new" and (out / OUTPUT_MARKER).is_file()
    # marked: DARE's to replace, whatever it holds
    (out / "extra.bin").write_text("x")
    with atomic_dir(out, writes=("config.json",)) as new:
        (new / "config.json").write_text("newer")
    assert sorted(p.name for p in out.iterdir()) == sorted([OUTPUT_MARKER, "config.json"])


def test_a_file_where_an_output_folder_goes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "models").write_text("a file of the user's")
    with pytest.raises(UserError, match="is a file, not a folder DARE wrote"):
        check_replaceable(tmp_path / "models")
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty")
    check_replaceable(tmp_path / "missing")


# --------------------------------------------------------------------------- params files


@pytest.mark.parametrize("text", ["", "# run:\n#   name: t\n", "{}\n", "run:\ndata:\nrecipe:\n"],
                         ids=["empty", "commented", "empty-mapping", "empty-sections"])
def test_a_params_file_without_settings_is_refused(tmp_path: Path, text: str) -> None:
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"params\.yaml: no settings: the sections run, data, model, .* are all "
                                          r"missing or empty"):
        load_config(tmp_path / "params.yaml", ["data.num_sft=10"], root=tmp_path)
    with pytest.raises(ConfigError, match="no settings"):
        load_config(os.devnull, root=tmp_path)


def test_unknown_keys_are_named_with_a_suggestion(tmp_path: Path) -> None:
    from dare_core.models.family import get_family

    params = write_params(tmp_path / "params.yaml", tiny_params(tmp_path))
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.pakcing' \(did you mean 'packing'\?\)"):
        load_config(params, ["model.pakcing=on"], root=tmp_path)
    with pytest.raises(ConfigError, match=r"^unknown setting model\.init\.n_layer; did you mean model\.init\.n_layers\?$"):
        get_family("llada").check_init({"n_layers": 2, "n_layer": 2})
    get_family("llada").check_init({"n_layers": 2, "max_sequence_length": "auto"})


def test_a_model_init_typo_stops_the_stage(layout: Path) -> None:
    from dare_core.data.prepare import prepare

    cfg = _load(layout, "model.init.n_layer=3", f"data.prepared_dir={layout / 'fresh'}")
    with pytest.raises(ConfigError, match=r"model\.init\.n_layer; did you mean model\.init\.n_layers\?"):
        prepare(cfg)
    assert not (layout / "fresh").exists()


def test_packing_on_and_off_read_as_documented(tmp_path: Path) -> None:
    for text, expected in (("on", "on"), ("off", "off"), ("auto", "auto"), ("yes", "on"), ("true", "on")):
        (tmp_path / "params.yaml").write_text(f"model:\n  packing: {text}\n")
        assert load_config(tmp_path / "params.yaml", root=tmp_path).model.packing == expected
        assert load_config(tmp_path / "params.yaml", [f"model.packing={text}"], root=tmp_path).model.packing == expected
    with pytest.raises(ConfigError, match=r"model\.packing' must be one of \['auto', 'on', 'off'\], got 'sometimes'"):
        load_config(tmp_path / "params.yaml", ["model.packing=sometimes"], root=tmp_path)
