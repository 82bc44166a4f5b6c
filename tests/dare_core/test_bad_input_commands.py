"""Bad input to `dare generate`, `dare eval` and `dare stage eval`: one `error:` line naming the
culprit, no traceback (unless --debug), nothing written (tests/bad_input.py).

Damaged model folders are copies of the project's exported model placed outside the watched
folders (runs/, models/, metrics/, data/), so the check also proves the original is untouched.
`dare eval` writes under --work-dir runs/dare-eval, so a run folder left behind would show.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest

from bad_input import assert_clean_failure, run, snapshot
from dare_core.data.schema import write_rows
from dare_core.models.tokenizer import load_tokenizer

SHARD = "model-00001-of-00001.safetensors"
LONG = "1" * 40 + "+1="  # the tiny model allows 24 positions


# ---- breaking an input (outside the watched folders); each returns nothing, the case names paths


def _copy_model(root: Path) -> Path:
    return Path(shutil.copytree(root / "models" / "t", root / "broken"))


def truncated_shard(root: Path) -> None:
    shard = _copy_model(root) / SHARD
    shard.write_bytes(shard.read_bytes()[:1000])


def invalid_json_config(root: Path) -> None:
    (_copy_model(root) / "config.json").write_text('{"model_type": "llada", ')


def non_utf8_config(root: Path) -> None:
    (_copy_model(root) / "config.json").write_bytes(b'{"model_type": "ll\xffada"}')


def no_tokenizer(root: Path) -> None:
    (_copy_model(root) / "tokenizer.json").unlink()


def long_prompt_eval_file(root: Path) -> None:
    tok = load_tokenizer(root / "models" / "t")
    rows = [{"prompt": p, "prompt_text": tok.apply_chat_template([{"role": "user", "content": p}]), "ground_truth": "2",
             "task": "arithmetic", "uid": uid} for uid, p in (("short", "1+1="), ("too_long", LONG))]
    write_rows(root / "long.parquet", rows, "eval")


def nothing(root: Path) -> None:
    pass


GEN = ("generate", "--prompt", "12+34=")
EVAL = ("eval", "--work-dir", "runs/dare-eval")

# (id, break the input, arguments after `dare`, text(s) the error line must contain)
CASES: list[tuple[str, Callable[[Path], None], tuple, object]] = [
    ("generate-missing-folder", nothing, (*GEN, "--model", "nowhere"), "model folder not found: nowhere"),
    ("generate-gen-length-0", nothing, (*GEN, "--model", "models/t", "--gen-length", "0"), "gen_length must be positive"),
    ("generate-block-kv-on-llada", nothing, (*GEN, "--model", "models/t", "--cache", "block_kv"),
     ["cache 'block_kv'", "masked-diffusion"]),
    ("generate-truncated-shard", truncated_shard, (*GEN, "--model", "broken"), f"broken/{SHARD}"),
    ("generate-no-tokenizer", no_tokenizer, (*GEN, "--model", "broken"), ["broken", "tokenizer.json"]),
    ("generate-invalid-json-config", invalid_json_config, (*GEN, "--model", "broken"), ["broken/config.json", "invalid JSON"]),
    ("generate-non-utf8-config", non_utf8_config, (*GEN, "--model", "broken"), ["broken/config.json", "UTF-8"]),
    ("generate-prompt-too-long", nothing, ("generate", "--model", "models/t", "--prompt", LONG), "max_sequence_length 24"),
    ("generate-empty-prompt", nothing, ("generate", "--model", "models/t", "--prompt", ""), "--prompt"),
    ("generate-blank-prompt", nothing, ("generate", "--model", "models/t", "--prompt", "  \n "), "--prompt"),
    ("generate-steps-over-gen-length", nothing, (*GEN, "--model", "models/t", "--steps", "8"), ["steps 8", "gen_length 4"]),
    ("eval-unknown-benchmark", nothing, (*EVAL, "--model", "models/t", "--benchmarks", "gsm8k,nonsense"),
     ["'nonsense'", "gsm8k", "mmlu"]),
    ("eval-missing-model", nothing, (*EVAL, "--model", "nowhere"), "model folder not found: nowhere"),
    ("eval-second-model-missing", nothing, (*EVAL, "--model", "models/t", "--model", "nowhere"), "nowhere"),
    ("eval-truncated-shard", truncated_shard, (*EVAL, "--model", "broken"), f"broken/{SHARD}"),
    ("eval-invalid-json-config", invalid_json_config, (*EVAL, "--model", "broken"), ["broken/config.json", "invalid JSON"]),
    ("eval-non-utf8-config", non_utf8_config, (*EVAL, "--model", "broken"), ["broken/config.json", "UTF-8"]),
    ("eval-no-tokenizer", no_tokenizer, (*EVAL, "--model", "broken"), ["broken", "tokenizer.json"]),
    ("eval-block-kv-on-llada", nothing, (*EVAL, "--model", "models/t", "--cache", "block_kv"), ["cache 'block_kv'", "'task'"]),
    ("eval-steps-over-gen-length", nothing, (*EVAL, "--model", "models/t", "--steps", "8"), ["steps 8", "gen_length 4"]),
    ("eval-prompt-too-long", long_prompt_eval_file, (*EVAL, "--model", "models/t", "--data", "long.parquet"),
     ["row 'too_long'", "max_sequence_length 24"]),
    ("eval-batch-size-0", nothing, (*EVAL, "--model", "models/t", "--batch-size", "0"), "--batch-size"),
    ("stage-eval-block-kv", nothing, ("stage", "eval", "-S", "eval.sampler.cache=block_kv"),
     ["runs/t/base", "cache 'block_kv'"]),
    ("stage-eval-steps-over-gen-length", nothing, ("stage", "eval", "-S", "eval.sampler.steps=8"),
     ["eval.sampler", "steps 8 > gen_length 4"]),
    ("stage-eval-truncated-checkpoint", truncated_shard,
     ("stage", "eval", "-S", "model.path=broken", "-S", "eval.checkpoints=[base]"), f"broken/{SHARD}"),
]


@pytest.mark.parametrize("damage, args, culprit", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_cleanly(project, damage, args, culprit):
    before = snapshot(project)
    damage(project)
    assert_clean_failure(run(project, *args), culprit, before, project)


def test_debug_shows_the_traceback(project):
    before = snapshot(project)
    for args in (("--debug", "generate", "--model", "nowhere", "--prompt", "1+1="),
                 ("generate", "--debug", "--model", "nowhere", "--prompt", "1+1="),
                 ("stage", "eval", "--debug", "-S", "eval.sampler.cache=block_kv")):
        result = run(project, *args)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback (most recent call last)" in result.stderr, args
        assert result.stderr.strip().splitlines()[-1].startswith("error: "), result.stderr[-2000:]
    assert snapshot(project) == before


def test_a_good_eval_still_writes_its_run(project):
    """The atomic run folder appears, complete, under --work-dir (the failing cases above prove it
    is absent after a failure)."""
    result = run(project, *EVAL, "--model", "models/t", "--max-samples", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (project / "runs" / "dare-eval").iterdir()
    assert {"manifest.json", "summary.md", "predictions", "results"} <= {p.name for p in run_dir.iterdir()}
