"""Validate, then touch: the training and data stages check every setting and input before they
modify any artifact, on a project that already holds data, checkpoints, models and metrics.

Each bad-input case runs `dare stage ...` on a fresh copy of that project and asserts
(`bad_input.assert_clean_failure`) a non-zero exit, one `error: ...` line naming the culprit, no
traceback, and every file under runs/, models/, metrics/ and data/ byte-identical (none added).
Bad source files are written outside those folders. Read-only folders are made immutable
(`chattr +i`, which stops root too, where permission bits do not) and a full disk is a small tmpfs
mounted over the folder: real conditions, skipped where the machine does not allow them.
Positive cases: a cosmetic change resumes, `--restart` starts fresh.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from bad_input import assert_clean_failure, run, snapshot
from pipeline_helpers import worker_env

SMALL = ("-S", "data.num_sft=10", "-S", "data.num_rl=10", "-S", "data.num_eval=4", "-S", "data.num_val=2",
         "-S", "data.num_preference=4")


# --------------------------------------------------------------------------- input makers


def _rows(n: int = 30) -> list[dict]:
    return [{"prompt": f"{i}+{i}=", "response": str(2 * i), "ground_truth": str(2 * i), "uid": f"u{i}"} for i in range(n)]


def _source(root: Path, rows: list, name: str = "raw.jsonl") -> str:
    """A data.source file beside (not inside) the watched folders; returns its relative path."""
    (root / name).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return name


def _prepare_with(rows: list) -> Callable:
    def setup(root: Path, stack: contextlib.ExitStack) -> tuple:
        return ("-S", f"data.source={_source(root, rows)}", *SMALL)
    return setup


def _edit_rows(path: str, column: str, index: int, value: str) -> Callable:
    """Overwrite one cell of a prepared parquet file (before the snapshot)."""
    def setup(root: Path, stack: contextlib.ExitStack) -> tuple:
        table = pq.read_table(root / path).to_pylist()
        table[index][column] = value
        pq.write_table(pa.Table.from_pylist(table), root / path)
        return ()
    return setup


def _immutable(top: str) -> Callable:
    """`top` and everything under it read-only for root too (chattr +i), like a read-only mount."""
    def setup(root: Path, stack: contextlib.ExitStack) -> tuple:
        done = subprocess.run(["chattr", "-R", "+i", str(root / top)], capture_output=True)
        stack.callback(subprocess.run, ["chattr", "-R", "-i", str(root / top)], capture_output=True)
        if done.returncode:
            pytest.skip(f"chattr +i is not available here: {done.stderr.decode()[-200:]}")
        return ()
    return setup


def _tmpfs(top: str, spare_bytes: int) -> Callable:
    """`top` on a tmpfs holding its current files and `spare_bytes` free: a real, nearly full disk."""
    def setup(root: Path, stack: contextlib.ExitStack) -> tuple:
        target, saved = root / top, root / f"{top}.saved"
        target.rename(saved)
        target.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)], capture_output=True)
        if mounted.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[-200:]}")
        stack.callback(subprocess.run, ["umount", "-l", str(target)], capture_output=True)
        shutil.copytree(saved, target, dirs_exist_ok=True, symlinks=True)
        st = os.statvfs(target)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        subprocess.run(["mount", "-o", f"remount,size={used + spare_bytes}", str(target)], check=True)
        return ()
    return setup


def _chain(*setups: Callable) -> Callable:
    def setup(root: Path, stack: contextlib.ExitStack) -> tuple:
        return tuple(a for s in setups for a in s(root, stack))
    return setup


def _bad_model_folder(config_bytes: bytes) -> Callable:
    """model.path: a copy of the exported model (outside the watched folders) with another config.json."""
    def setup(root: Path, stack: contextlib.ExitStack) -> tuple:
        shutil.copytree(root / "models" / "t", root / "badmodel")
        (root / "badmodel" / "config.json").write_bytes(config_bytes)
        return ("-S", "model.path=badmodel")
    return setup


def _mutate(fn: Callable[[Path], None]) -> Callable:
    def setup(root: Path, stack: contextlib.ExitStack) -> tuple:
        fn(root)
        return ()
    return setup


def _drop_settings(root: Path) -> None:
    """A checkpoint written before checkpoints recorded their settings."""
    path = root / "runs/t/sft/checkpoints/step00000020/dare_checkpoint.json"
    meta = json.loads(path.read_text())
    del meta["settings"], meta["inputs"]
    path.write_text(json.dumps(meta))


def _reverse_rows(path: str) -> Callable[[Path], None]:
    def fn(root: Path) -> None:
        table = pq.read_table(root / path)
        pq.write_table(table.take(list(reversed(range(table.num_rows)))), root / path)
    return fn


def _touch(path: str) -> Callable[[Path], None]:
    def fn(root: Path) -> None:
        st = os.stat(root / path)
        os.utime(root / path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    return fn


def _file_instead_of(folder: str) -> Callable[[Path], None]:
    def fn(root: Path) -> None:
        shutil.rmtree(root / folder)
        (root / folder).write_text("not a folder\n")
    return fn


# --------------------------------------------------------------------------- the cases


@dataclass
class Case:
    id: str
    stage: str
    args: tuple
    culprit: object
    setup: Optional[Callable] = None
    max_seconds: float = 120.0


def _set(*pairs: str) -> tuple:
    return tuple(a for p in pairs for a in ("-S", p))


GOOD = _rows()
CASES = [
    # settings out of range: named by their full key, before anything runs
    Case("sft-save-every-0", "sft", _set("sft.save_every=0"), "sft.save_every"),
    Case("sft-log-every-0", "sft", _set("sft.log_every=0"), "sft.log_every"),
    Case("sft-max-steps-0", "sft", _set("sft.max_steps=0"), "sft.max_steps"),
    Case("sft-max-steps-negative", "sft", _set("sft.max_steps=-5"), "sft.max_steps"),
    Case("sft-micro-batch-0", "sft", _set("sft.micro_batch_size=0"), "sft.micro_batch_size"),
    Case("sft-keep-last-0", "sft", _set("sft.keep_last=0"), "sft.keep_last"),
    Case("sft-lr-schedule", "sft", _set("sft.optim.schedule=cos"), "sft.optim.schedule"),
    Case("rl-num-steps-negative", "rl", _set("rl.num_steps=-1"), "rl.num_steps"),
    Case("rl-save-every-0", "rl", _set("rl.save_every=0"), "rl.save_every"),
    Case("rl-sampler-batch-0", "rl", _set("rl.sampler.batch_size=0"), "rl.sampler.batch_size"),
    Case("preference-max-steps-0", "preference", _set("preference.max_steps=0"), "preference.max_steps"),
    Case("preference-micro-batch-0", "preference", _set("preference.micro_batch_size=0"), "preference.micro_batch_size"),
    Case("zero-stage", "sft", _set("launch.zero_stage=7"), "launch.zero_stage"),
    Case("offload-without-zero", "sft", _set("launch.offload_optimizer=cpu"), ("launch.offload_optimizer", "zero_stage")),
    # settings that do not fit the model, the data or each other
    Case("rl-block-kv-on-llada", "rl", _set("rl.sampler.cache=block_kv"), ("rl.sampler.cache", "block_kv")),
    Case("rl-unknown-reward", "rl", _set("rl.reward=nope"), "rl.reward"),
    Case("rl-lmdeploy-on-llada", "rl", _set("rl.sampler.engine=lmdeploy"), ("rl.sampler.engine 'lmdeploy'", "SDAR")),
    Case("rl-unknown-engine", "rl", _set("rl.sampler.engine=vllm"), ("unknown rollout engine 'vllm'", "native")),
    Case("rl-reward-for-other-ground-truths", "rl", _set("rl.reward=countdown"), ("rl.parquet", "ground_truth")),
    Case("rl-validate-k-0", "rl", _set("rl.validate_every=1", "rl.validate_k=0"), "rl.validate_k"),
    Case("rl-canvas-too-long", "rl", _set("rl.sampler.gen_length=32", "rl.sampler.steps=8"), "rl.sampler.gen_length"),
    Case("rl-lora-dropout", "rl", _set("model.lora={r: 4, alpha: 8, dropout: 0.1}"), ("model.lora.dropout: 0", "got 0.1")),
    Case("sft-unknown-family", "sft", _set("model.family=nope"), "model.family"),
    Case("sft-pad-to-too-long-with-restart", "sft", ("--restart", *_set("sft.pad_to=40")), ("sft.parquet", "sft.pad_to")),
    # checkpoints made with other settings or inputs: refused, naming what changed
    Case("sft-lr-changed", "sft", _set("sft.optim.lr=0.01"), ("sft.optim.lr: 0.003 -> 0.01", "--restart")),
    Case("rl-lr-changed", "rl", _set("rl.optim.lr=0.5"), ("rl.optim.lr", "--restart")),
    Case("preference-beta-changed", "preference", _set("preference.beta=0.5"), ("preference.beta: 0.2 -> 0.5", "--restart")),
    Case("sft-data-changed", "sft", (), ("the data file data/prepared/sft.parquet changed", "--restart"),
         _mutate(_reverse_rows("data/prepared/sft.parquet"))),
    Case("rl-start-model-changed", "rl", (), ("the start model runs/t/sft/model changed", "--restart"),
         _mutate(_touch("runs/t/sft/model/config.json"))),
    Case("sft-legacy-checkpoint", "sft", (), ("older DARE", "--restart"), _mutate(_drop_settings)),
    # prepared data that a later stage cannot use
    Case("rl-non-integer-ground-truth", "rl", (), ("rl.parquet: row 4", "ground_truth", "'1.5'"),
         _edit_rows("data/prepared/rl.parquet", "ground_truth", 3, "1.5")),
    Case("convert-no-checkpoint", "convert", (), "runs/t/rl/checkpoints/latest",
         _mutate(lambda root: (root / "runs/t/rl/checkpoints/latest").unlink())),
    # bad data.source files
    Case("prepare-non-integer-ground-truth", "prepare", (), ("raw.jsonl: line 8", "ground_truth", "'14.5'"),
         _prepare_with([*GOOD[:7], {**GOOD[7], "ground_truth": "14.5"}, *GOOD[8:]])),
    Case("prepare-duplicate-uid", "prepare", (), ("raw.jsonl: lines 3 and 6", "'u2'"),
         _prepare_with([*GOOD[:5], {**GOOD[5], "uid": "u2"}, *GOOD[6:]])),
    Case("prepare-conflicting-answers", "prepare", (), ("raw.jsonl: lines 4 and 31", "same prompt"),
         _prepare_with([*GOOD, {**GOOD[3], "uid": "x", "response": "7", "ground_truth": "7"}])),
    Case("prepare-unknown-task", "prepare", (), ("raw.jsonl: line 1", "'poetry'"),
         _prepare_with([{**r, "task": "poetry"} for r in GOOD])),
    Case("prepare-invalid-json", "prepare", (), ("raw.jsonl", "line 4"), _prepare_with([*GOOD[:3], "{not json", *GOOD[3:]])),
    Case("prepare-non-utf8", "prepare", (), ("raw.jsonl", "line 2", "UTF-8"),
         _chain(_prepare_with(GOOD), _mutate(lambda root: (root / "raw.jsonl").write_bytes(
             (root / "raw.jsonl").read_bytes().replace(b"1+1=", b"1+1=\xff\xfe", 1))))),
    Case("prepare-source-is-a-directory", "prepare", ("-S", "data.source=x.jsonl"), ("x.jsonl", "directory"),
         _mutate(lambda root: (root / "x.jsonl").mkdir())),
    Case("prepare-source-missing", "prepare", ("-S", "data.source=nowhere.jsonl"), "nowhere.jsonl"),
    Case("prepare-source-garbage-parquet", "prepare", ("-S", "data.source=raw.parquet"), "raw.parquet",
         _mutate(lambda root: (root / "raw.parquet").write_bytes(b"PAR1 garbage"))),
    Case("prepare-huge-prompt", "prepare", (), ("raw.jsonl: line 5", "prompt", "characters"),
         _prepare_with([*GOOD[:4], {**GOOD[4], "prompt": "1" * 20_000_000}, *GOOD[5:]]), max_seconds=30),
    # model folders with a broken config.json: the file is named
    Case("prepare-model-config-invalid-json", "prepare", (), ("badmodel/config.json", "JSON"),
         _bad_model_folder(b'{"model_type": "llada",')),
    Case("prepare-model-config-not-utf8", "prepare", (), ("badmodel/config.json", "UTF-8"),
         _bad_model_folder(b'{"model_type": "\xff"}')),
    Case("sft-model-config-invalid-json", "sft", (), ("badmodel/config.json", "JSON"), _bad_model_folder(b"[1, 2")),
    # outputs that cannot be written
    Case("sft-metrics-is-a-file", "sft", (), ("metrics", "not a directory"), _mutate(_file_instead_of("metrics"))),
    Case("sft-read-only-runs", "sft", (), ("runs/t/sft", "permission denied"), _immutable("runs")),
    Case("rl-read-only-runs", "rl", (), ("runs/t/rl", "permission denied"), _immutable("runs")),
    Case("prepare-read-only-data", "prepare", (), ("data/prepared", "permission denied"), _immutable("data")),
    Case("convert-read-only-models", "convert", (), ("models/t", "permission denied"), _immutable("models")),
    Case("sft-disk-full", "sft", (), ("not enough free disk space", "runs/t/sft"), _tmpfs("runs", 64 * 1024)),
    Case("prepare-disk-full", "prepare", (), ("data/prepared", "No space left"), _tmpfs("data", 8 * 1024)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_cleanly(project: Path, case: Case) -> None:
    with contextlib.ExitStack() as stack:
        extra = case.setup(project, stack) if case.setup else ()
        before = snapshot(project)
        t0 = time.time()
        result = run(project, "stage", case.stage, *case.args, *extra)
        assert_clean_failure(result, case.culprit, before, project)
        assert time.time() - t0 < case.max_seconds, f"rejected after {time.time() - t0:.0f} s"


# --------------------------------------------------------------------------- what must still work


def _weights(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _checkpoints(root: Path, stage: str) -> list[str]:
    return sorted(p.name for p in (root / "runs/t" / stage / "checkpoints").iterdir() if p.is_dir())


def test_cosmetic_change_resumes(project: Path) -> None:
    """log_every, save_every and keep_last do not change the weights: a run stopped after step 10
    resumes under new values of all three and ends with the weights of the uninterrupted run."""
    ckpts = project / "runs/t/sft/checkpoints"
    shutil.rmtree(ckpts / "step00000020")
    (ckpts / "latest").write_text("step00000010")
    before = _weights(project / "runs/t/sft/model")
    r = run(project, "stage", "sft", *_set("sft.log_every=5", "sft.save_every=5", "sft.keep_last=3"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming SFT from step00000010" in r.stderr
    after = _weights(project / "runs/t/sft/model")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert _checkpoints(project, "sft") == ["step00000010", "step00000015", "step00000020"]
    assert [json.loads(line)["step"] for line in (project / "runs/t/sft/metrics.jsonl").read_text().splitlines()] == [5, 10, 15, 20]
    assert math.isfinite(json.loads((project / "metrics/sft.json").read_text())["final_loss"])


def test_finished_run_resumed_reports_its_loss(project: Path) -> None:
    """Resumed at its last step a run trains nothing; its summary keeps the logged loss (not NaN)."""
    logged = json.loads((project / "runs/t/sft/metrics.jsonl").read_text().splitlines()[-1])["loss"]
    r = run(project, "stage", "sft")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((project / "metrics/sft.json").read_text())["final_loss"] == logged


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _kept_set(folder: Path) -> dict:
    """A set in superseded/ without its note (set_aside.json: when, why, its settings)."""
    files = _tree(folder)
    note = json.loads(files.pop("set_aside.json"))
    assert note["settings"] and note["why"], note
    logs = {k for k in files if k.startswith("logs/")}
    assert "logs/metrics.jsonl" in logs, sorted(files)  # what the run logged is kept with it
    return {k: v for k, v in files.items() if k not in logs}


def test_restart_sets_old_checkpoints_aside_and_trains(project: Path) -> None:
    old = _weights(project / "runs/t/sft/model")
    old_checkpoints = _tree(project / "runs/t/sft/checkpoints")
    r = run(project, "stage", "sft", "--restart", *_set("sft.optim.lr=0.01", "sft.max_steps=6", "sft.save_every=3"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" not in r.stderr
    assert _kept_set(project / "runs/t/sft/superseded/0001") == old_checkpoints  # set aside byte for byte, not deleted
    assert _checkpoints(project, "sft") == ["step00000003", "step00000006"]
    meta = json.loads((project / "runs/t/sft/checkpoints/step00000006/dare_checkpoint.json").read_text())
    assert meta["settings"]["sft.optim.lr"] == 0.01 and meta["settings"]["sft.max_steps"] == 6
    assert [json.loads(line)["step"] for line in (project / "runs/t/sft/metrics.jsonl").read_text().splitlines()] == [5, 6]
    new = _weights(project / "runs/t/sft/model")
    assert any(not torch.equal(old[k], new[k]) for k in old)
    # the new checkpoints are this run's: the same settings resume them
    again = run(project, "stage", "sft", *_set("sft.optim.lr=0.01", "sft.max_steps=6", "sft.save_every=3"))
    assert again.returncode == 0 and "resuming SFT from step00000006" in again.stderr, again.stderr[-3000:]


def test_restart_if_changed_resumes_matching_checkpoints_and_sets_others_aside(project: Path) -> None:
    """The DVC pipeline's mode (dvc.yaml): DVC reruns a stage when its params changed."""
    ckpts = project / "runs/t/rl/checkpoints"
    kept = _tree(ckpts)
    same = run(project, "stage", "rl", "--restart-if-changed", *_set("rl.log_every=2"))
    # step 3, the last, is of the weights only (rl.save_every 2): nothing left to train
    assert same.returncode == 0 and "resuming RL from step00000003 (step 3, the last; weights only" in same.stderr, \
        same.stderr[-3000:]
    assert _tree(ckpts) == kept and not (project / "runs/t/rl/superseded").exists()
    changed = run(project, "stage", "rl", "--restart-if-changed", *_set("rl.optim.lr=0.0002"))
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert "resuming" not in changed.stderr and "rl.optim.lr: 0.0001 -> 0.0002" in changed.stderr
    assert _kept_set(project / "runs/t/rl/superseded/0001") == kept
    meta = json.loads((ckpts / "step00000003" / "dare_checkpoint.json").read_text())
    assert meta["settings"]["rl.optim.lr"] == 0.0002
    # bad settings still fail before anything moves
    before = snapshot(project)
    bad = run(project, "stage", "rl", "--restart-if-changed", *_set("rl.sampler.cache=block_kv"))
    assert_clean_failure(bad, "block_kv", before, project)


def test_an_edit_to_a_user_reward_or_what_it_imports_retrains(project: Path) -> None:
    """A user reward's source, and the project's modules it imports, are inputs of the RL stage: after
    an edit the stage never resumes checkpoints trained under the old code; it names the edited file."""
    (project / "grading_util.py").write_text("def same(a, b):\n    return float(a.strip() == b.strip())\n")
    (project / "my_reward.py").write_text("from grading_util import same\n\n\n"
                                          "def score(completion, ground_truth, row):\n    return same(completion, ground_truth)\n")
    reward = _set("rl.reward=my_reward:score")
    first = run(project, "stage", "rl", "--restart-if-changed", *reward)
    assert first.returncode == 0 and "resuming" not in first.stderr, first.stderr[-3000:]
    same = run(project, "stage", "rl", *reward)
    assert same.returncode == 0 and "resuming RL from step00000003" in same.stderr, same.stderr[-3000:]
    (project / "grading_util.py").write_text("def same(a, b):\n    return float(a.strip().lower() == b.strip().lower())\n")
    before = snapshot(project)
    refused = run(project, "stage", "rl", *reward)
    assert_clean_failure(refused, "the reward module grading_util grading_util.py changed", before, project)
    changed = run(project, "stage", "rl", "--restart-if-changed", *reward)
    assert changed.returncode == 0 and "resuming" not in changed.stderr, changed.stderr[-3000:]
    assert "the reward module grading_util grading_util.py changed" in changed.stderr
    meta = json.loads((project / "runs/t/rl/checkpoints/step00000003/dare_checkpoint.json").read_text())
    assert meta["inputs"]["reward module grading_util"]["path"] == "grading_util.py"


@pytest.mark.parametrize("body,culprit", [
    ("raise KeyError('answer')", "raised KeyError on row val-0: 'answer' (1 of 64 responses so far, rl.reward_errors_allowed 0)"),
    ("return None", "returned None (NoneType) on row val-0; expected a number or a dict with 'score' "
                    "(a reward must return a finite number)"),
])
def test_a_broken_user_reward_stops_rl_with_one_line_and_keeps_the_last_run(project: Path, body: str, culprit: str) -> None:
    """A reward of the user's that raises (or returns no number) ends the RL stage at the first batch
    it grades, with one line naming the function, the row and the exception; the previous run's
    checkpoints and logs are kept in superseded/ (the fresh start set them aside)."""
    stage = project / "runs/t/rl"
    kept = _tree(stage / "checkpoints")
    logged = {name: (stage / name).read_bytes() for name in ("metrics.jsonl", "validation.jsonl")}
    (project / "bad_reward.py").write_text(f"def score(completion, ground_truth, row):\n    {body}\n")
    broken = run(project, "stage", "rl", "--restart-if-changed", *_set("rl.reward=bad_reward:score"))
    assert broken.returncode != 0 and "Traceback" not in broken.stderr, broken.stderr[-3000:]
    last = [line for line in broken.stderr.splitlines() if line.strip()][-1]
    assert last == f"error: reward 'bad_reward:score' {culprit}", broken.stderr[-3000:]
    assert _kept_set(stage / "superseded/0001") == kept
    assert {name: (stage / "superseded/0001/logs" / name).read_bytes() for name in logged} == logged


def test_a_broken_user_reward_stops_eval_and_keeps_the_earlier_results(project: Path) -> None:
    assert run(project, "stage", "eval").returncode == 0
    (project / "bad_reward.py").write_text("def score(completion, ground_truth, row):\n    raise KeyError('x')\n")
    assert run(project, "stage", "prepare", *_set("rl.reward=bad_reward:score")).returncode == 0  # rows name their reward
    before = snapshot(project)
    bad = run(project, "stage", "eval", *_set("rl.reward=bad_reward:score"))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    last = [line for line in bad.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and "reward 'bad_reward:score' raised KeyError on row eval-0: 'x'" in last, last
    assert snapshot(project) == before  # the results of the earlier eval, untouched


def test_config_file_rejects_restart_as_a_key(tmp_path: Path) -> None:
    from dare_core.config import ConfigError, load_config

    (tmp_path / "params.yaml").write_text("restart: true\n")
    with pytest.raises(ConfigError, match=r"'restart' is not a config key but a command-line flag \(--restart\)"):
        load_config(tmp_path / "params.yaml")


# --------------------------------------------------------------------------- units


def test_fingerprint_names_what_changed(tmp_path: Path) -> None:
    from dare_core.training.fingerprint import Fingerprint

    data = tmp_path / "sft.parquet"
    data.write_bytes(b"one")
    old = Fingerprint.of({"sft": {"optim": {"lr": 0.003, "betas": (0.9, 0.999)}, "max_steps": 20}, "run": {"seed": 0}}, {"data file": data})
    stored = {"fingerprint": old.digest, "settings": json.loads(json.dumps(old.settings)), "inputs": old.inputs}
    same = Fingerprint.of({"sft": {"optim": {"lr": 0.003, "betas": [0.9, 0.999]}, "max_steps": 20}, "run": {"seed": 0}}, {"data file": data})
    assert same.digest == old.digest and same.changes(stored) == []
    data.write_bytes(b"two")
    new = Fingerprint.of({"sft": {"optim": {"lr": 0.01, "betas": [0.9, 0.999]}}, "run": {"seed": 0}}, {"data file": data})
    assert new.digest != old.digest
    assert new.changes(stored) == ["sft.max_steps: 20 -> (not set)", "sft.optim.lr: 0.003 -> 0.01", f"the data file {data} changed"]


_SAVE_ON_A_FULL_DISK = r"""
import sys
from pathlib import Path
from dare_core.config import OptimConfig
from dare_core.diffusion.seeding import generator
from dare_core.errors import UserError
from dare_core.models.llada import tiny_config
from dare_core.models.lm import build_model
from dare_core.training import engine as eng
from dare_core.training.checkpoint import CheckpointManager
from dare_core.training.fingerprint import Fingerprint
from dare_core.training.preflight import checkpoint_bytes

model = build_model(tiny_config(40, 39, 38, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=128,
                                max_sequence_length=32))
model.net.init_weights(generator(0, "init"))
engine = eng.build_engine(model, OptimConfig(), 10, 1)
import torch
engine.backward(engine(torch.arange(8)[None]).float().pow(2).mean())  # one step: Adam's moments exist
engine.step()
size = checkpoint_bytes(model, next(model.parameters()).dtype)
ckpt = CheckpointManager(Path(sys.argv[1]), 2, Fingerprint.of({}, {}), "sft", checkpoint_bytes=size)
ckpt.save(engine, 1, {"step": 1}, model.hf_config)
try:
    ckpt.save(engine, 2, {"step": 2}, model.hf_config)
except UserError as exc:
    print("USER_ERROR", exc)
"""


def test_a_full_disk_during_a_checkpoint_leaves_the_last_one_whole(tmp_path: Path) -> None:
    """A real DeepSpeed save on a tmpfs with room for one checkpoint: the second fails with a
    UserError naming the disk, leaves no `.tmp-step*` folder, and the first stays `latest`."""
    from dare_core.training.preflight import checkpoint_bytes
    from dare_core.models.llada import tiny_config
    from dare_core.models.lm import build_model

    model = build_model(tiny_config(40, 39, 38, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=128,
                                    max_sequence_length=32), device="meta")
    size = checkpoint_bytes(model, torch.float32)
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[-200:]}")
    try:
        r = subprocess.run([sys.executable, "-c", _SAVE_ON_A_FULL_DISK, str(disk / "checkpoints")], env=worker_env(),
                           capture_output=True, text=True, timeout=300)
        assert "USER_ERROR" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
        assert "disk is full" in r.stdout and "step00000002" in r.stdout
        ckpts = disk / "checkpoints"
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step00000001"]
        assert (ckpts / "latest").read_text().strip() == "step00000001"
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_outputs_written_together_are_all_new_or_all_old(tmp_path: Path) -> None:
    """`atomic_dirs`: when the second swap fails (an immutable old folder cannot be moved aside),
    the first is put back; both hold their old files and no temporary folder is left."""
    from dare_core.errors import UserError
    from dare_core.ownership import OUTPUT_MARKER
    from dare_core.storage import atomic_dirs

    first, second = tmp_path / "prepared", tmp_path / "tokenizer"
    for folder in (first, second):
        folder.mkdir()
        (folder / "old.txt").write_text("old")
        (folder / OUTPUT_MARKER).write_text("")  # outputs of an earlier run (a folder of the user's is never replaced)
    locked = subprocess.run(["chattr", "+i", str(second)], capture_output=True)
    if locked.returncode:
        pytest.skip(f"chattr +i is not available here: {locked.stderr.decode()[-200:]}")
    try:
        with pytest.raises(UserError, match="prepared, .*tokenizer failed, nothing was changed"):
            with atomic_dirs(first, second) as (a, b):
                (a / "new.txt").write_text("new")
                (b / "new.txt").write_text("new")
    finally:
        subprocess.run(["chattr", "-i", str(second)], capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared", "tokenizer"]
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir()) == [OUTPUT_MARKER, "old.txt"]
