"""The `dare` command: help, and generate/eval on any checkpoint folder."""
import json

import pytest

from dare_core.cli import main
from dare_core.data.schema import write_rows
from dare_core.diffusion.seeding import generator
from dare_core.models.hf_folder import save_model
from dare_core.models.llada import tiny_config
from dare_core.models.lm import build_model
from dare_core.models.tokenizer import build_char_tokenizer


@pytest.fixture
def folder(tmp_path):
    tok = build_char_tokenizer(tmp_path / "tok")
    model = build_model(tiny_config(tok.vocab_size, tok.mask_token_id, tok.eos_token_id, d_model=32, n_layers=1, n_heads=2,
                                    n_kv_heads=2, mlp_hidden_size=32, max_sequence_length=32))
    model.net.init_weights(generator(0, "cli"))
    sampler = {"gen_length": 4, "steps": 2, "block_length": 4, "temperature": 0.0}
    return save_model(model, tmp_path / "m", extra_files={"tokenizer": tmp_path / "tok"}, sampler=sampler), tok


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("stage", "upload", "run", "generate", "eval", "workspaces"):
        assert cmd in out


def test_a_stage_cmd_maps_to_the_upload_of_the_same_config():
    """The flow copies a restored stage's outputs with `dare upload`: same stage, params file, -S
    keys and recipe (applied first, as `dare stage` does); no upload for a cmd that is not a stage."""
    from dare_core.cli import upload_argv

    assert upload_argv("dare stage sft --restart-if-changed") == ["upload", "sft", "--params", "params.yaml"]
    assert upload_argv("dare stage rl -S rl.num_steps=3 --recipe d1 --params p.yaml --restart") == \
        ["upload", "rl", "--params", "p.yaml", "--set=recipe=d1", "--set=rl.num_steps=3"]
    for other in ("python eval.py", "dare stage nope", "dare eval --model m", "echo 'unclosed"):
        assert upload_argv(other) is None


def test_generate_and_eval_use_the_folders_sampler(folder, tmp_path, capsys):
    path, tok = folder
    assert main(["generate", "--model", str(path), "--prompt", "12+34="]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    assert len(tok.encode(text)) <= 4  # gen_length 4 from generation_config.json
    rows = [{"prompt": "1+1=", "prompt_text": tok.apply_chat_template([{"role": "user", "content": "1+1="}]),
             "ground_truth": "2", "task": "arithmetic", "uid": "e0"}]
    write_rows(tmp_path / "eval.parquet", rows, "eval")
    work = tmp_path / "work"
    assert main(["eval", "--model", str(path), "--data", str(tmp_path / "eval.parquet"), "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert "| benchmark | m |" in out and "| arithmetic |" in out  # through OpenCompass, one column per model
    (run,) = [d for d in work.iterdir() if d.is_dir()]
    assert (run / "summary.md").exists()
    assert json.loads((run / "manifest.json").read_text())["benchmarks"][0]["name"] == "task"


def test_generate_takes_the_familys_rule_and_the_editing_modes(tmp_path, capsys):
    """A DiffusionGemma folder exported without a sampler decodes with its family's rule; --editing
    picks LLaDA2.1's settings on a block family."""
    from eval_helpers import tiny_folder

    dg = tiny_folder(tmp_path, "diffusion_gemma")
    assert main(["generate", "--model", str(dg), "--prompt", "12+34=", "--gen-length", "8", "--steps", "4"]) == 0
    assert isinstance(capsys.readouterr().out, str)
    sdar = tiny_folder(tmp_path, "sdar")
    assert main(["generate", "--model", str(sdar), "--prompt", "12+34=", "--gen-length", "8", "--steps", "8",
                 "--block-length", "4", "--editing", "speed"]) == 0


# ---- the one error printer shared by `dare` and every stage worker (dare_core/workers/common.py)


def _fail(exc):
    def fn():
        raise exc
    return fn


def test_expected_failures_are_one_line_with_the_path_and_code(capsys):
    import errno

    from dare_core.errors import UserError
    from dare_core.workers.common import run_reporting_errors

    cases = [(OSError(errno.ENOSPC, "No space left on device", "runs/t/eval"), "error: runs/t/eval: No space left on device", 1),
             (OSError(errno.EROFS, "Read-only file system", "models/t"), "error: models/t: Read-only file system", 1),
             (FileNotFoundError(errno.ENOENT, "No such file or directory", "data/x.parquet"),
              "error: data/x.parquet: No such file or directory", 2),
             (UserError("a message\nover two lines"), "error: a message over two lines", 2)]
    for exc, line, code in cases:
        assert run_reporting_errors(_fail(exc)) == code
        err = capsys.readouterr().err
        assert err == line + "\n"
    assert run_reporting_errors(lambda: 0) == 0 and run_reporting_errors(lambda: None) == 0


def test_debug_adds_the_traceback_and_bugs_keep_theirs(capsys):
    from dare_core.workers.common import run_reporting_errors

    assert run_reporting_errors(_fail(ValueError("bad value")), debug=True) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.endswith("error: bad value\n")
    with pytest.raises(KeyError):  # a bug is not an expected failure: its traceback is not swallowed
        run_reporting_errors(_fail(KeyError("oops")))


def test_eval_fails_before_writing_anything(folder, tmp_path, capsys):
    path, _ = folder
    work = tmp_path / "deep" / "work"
    assert main(["eval", "--model", str(path), "--model", str(tmp_path / "nope"), "--data", str(tmp_path / "none.parquet"),
                 "--work-dir", str(work)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "deep").exists()


def test_dare_stage_fills_in_dare_env_for_its_workers(monkeypatch):
    from pathlib import Path

    import dare_core.cli
    from dare_core.process.env_file import env_defaults

    repo = Path(__file__).resolve().parents[2]
    for key in env_defaults(repo):  # (set, then unset: whatever `dare stage` sets is undone after the test)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # the user's choice
    monkeypatch.chdir(repo)
    seen: dict = {}
    monkeypatch.setattr(dare_core.cli, "_launch", lambda cmd, env, what: seen.update(env) or 1)
    assert main(["stage", "sft"]) == 1
    assert seen["TORCH_EXTENSIONS_DIR"] == str(repo / ".cache" / "torch_extensions")
    assert seen["HF_HUB_OFFLINE"] == "1" and seen["HF_DATASETS_OFFLINE"] == "0"
