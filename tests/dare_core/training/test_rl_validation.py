"""In-loop validation of `dare stage rl` on a tiny config: a row per validated step in
validation.jsonl, validation.csv (the `dvc plots` curve) and the RL metrics, a plot, no duplicate rows
after a resume, the same training
with validation on or off, and clear errors for settings it cannot run with."""
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from dare_core.config import RLConfig, SamplerConfig, load_config
from dare_core.data.prepare import prepare
from dare_core.training.rl.validation import check_validation_config, due, plot_validation, validation_csv
from pipeline_helpers import dare, tiny_params, worker_env, write_params

KEYS = ("val/mean@4", "val/best@4", "val/maj@4")
# one-digit sums, 60 of them for SFT: a held-out sum is right now and then, so the metrics are not all 0
DATA = {"data__task_args": {"min_digits": 1, "max_digits": 1, "ops": "+", "zero_pad": True},
        "data__num_sft": 60, "data__num_rl": 20, "data__num_eval": 10, "data__num_val": 16}


def _run(params: Path, stage: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(dare("stage", stage, "--params", str(params), *extra), env=worker_env(), capture_output=True, text=True)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _csv_matches(out: Path, rows: list[dict]) -> bool:
    """validation.csv holds `rows`: a line per (step, metric) in order, the values of validation.jsonl."""
    lines = (out / "validation.csv").read_text().splitlines()
    want = []
    for r in rows:
        names = [f"{m}@{r['k']}" for m in ("mean", "best", "maj")]
        want += [f"{r['step']},{name},{r[name]}" for name in names]
    return lines == ["step,metric,accuracy", *want]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """Prepared data and a trained SFT model, shared by the RL runs below (each copies it)."""
    root = tmp_path_factory.mktemp("sft")
    params = write_params(root / "params.yaml", tiny_params(root, **DATA, sft__max_steps=150))
    prepare(load_config(params))
    r = _run(params, "sft")
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def _rl_root(sft_run: Path, dest: Path, **over) -> Path:
    shutil.copytree(sft_run / "data", dest / "data")
    shutil.copytree(sft_run / "runs" / "t" / "sft", dest / "runs" / "t" / "sft")
    over = {**DATA, "rl__num_steps": 3, "rl__save_every": 2, "rl__keep_last": 3, "rl__validate_k": 4, **over}
    return write_params(dest / "params.yaml", tiny_params(dest, **over))


def test_rl_validates_every_step_and_resumes_without_duplicates(sft_run, tmp_path):
    params = _rl_root(sft_run, tmp_path, rl__validate_every=1)
    r = _run(params, "rl")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "runs" / "t" / "rl"
    rows = _jsonl(out / "validation.jsonl")
    assert [v["step"] for v in rows] == [0, 1, 2, 3]
    for v in rows:
        assert v["k"] == 4 and v["prompts"] == 16
        assert 0.0 <= v["mean@4"] <= v["best@4"] <= 1.0 and 0.0 <= v["maj@4"] <= 1.0
    assert any(v["best@4"] > 0 for v in rows)
    assert r.stderr.count("validation at step") == 4 and "validation at step 3 (16 prompts x 4 samples" in r.stderr
    png = (out / "validation.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert _csv_matches(out, rows)
    for key in ("reward", "accuracy"):  # the RL curves' PNGs, beside their CSVs
        assert (out / f"{key}.png").read_bytes().startswith(b"\x89PNG") and (out / f"{key}.csv").is_file()
    # the RL metrics: step 0 holds the SFT model's validation alone, every step after it both
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert set(metrics[0]) == {"step", *KEYS}
    for m, v in zip(metrics, rows):
        assert [m[key] for key in KEYS] == [v["mean@4"], v["best@4"], v["maj@4"]]
    assert all("reward" in m for m in metrics[1:])
    assert json.loads((tmp_path / "metrics" / "rl.json").read_text())["validation"] == rows[-1]

    # killed after step 2's checkpoint: the resumed run validates step 3 once more, and only it
    ckpts = out / "checkpoints"
    shutil.rmtree(ckpts / "step00000003")
    (ckpts / "latest").write_text("step00000002")
    r = _run(params, "rl")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming RL from step00000002" in r.stderr and "validation at step 2 " not in r.stderr
    again = _jsonl(out / "validation.jsonl")
    assert [v["step"] for v in again] == [0, 1, 2, 3]
    # the rows before the resumed step are kept as they were; step 3 is redone from the same weights
    drop = ("time_s",)
    assert [{k: v for k, v in row.items() if k not in drop} for row in again] == [{k: v for k, v in row.items() if k not in drop} for row in rows]
    assert [m["step"] for m in _jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert (out / "validation.png").read_bytes().startswith(b"\x89PNG")
    assert _csv_matches(out, again)  # no duplicate of step 3


def test_validation_does_not_change_training(sft_run, tmp_path):
    """Every other step with validation, none without: the same rollouts, rewards and losses; off
    leaves an empty validation.jsonl (a DVC output) and no val keys."""
    runs = {}
    for name, every in (("on", 2), ("off", 0)):
        (tmp_path / name).mkdir()
        params = _rl_root(sft_run, tmp_path / name, rl__validate_every=every)
        r = _run(params, "rl")
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = tmp_path / name / "runs" / "t" / "rl"
    on, off = _jsonl(runs["on"] / "metrics.jsonl"), _jsonl(runs["off"] / "metrics.jsonl")
    assert [v["step"] for v in _jsonl(runs["on"] / "validation.jsonl")] == [0, 2, 3]  # every 2, and the last
    assert (runs["off"] / "validation.jsonl").read_text() == "\n" and not (runs["off"] / "validation.png").exists()
    assert (runs["off"] / "validation.csv").read_text() == "step,metric,accuracy\n"  # a DVC plot output, empty
    assert _csv_matches(runs["on"], _jsonl(runs["on"] / "validation.jsonl"))
    train_on = [m for m in on if m["step"] > 0]
    assert [m["step"] for m in train_on] == [m["step"] for m in off] == [1, 2, 3]
    for a, b in zip(train_on, off):
        assert not any(key.startswith("val/") for key in b)
        for key in ("reward", "accuracy", "loss", "response_tokens"):
            assert a[key] == b[key] and math.isfinite(a[key]), (a["step"], key)


def test_missing_val_split_is_one_clear_error(sft_run, tmp_path):
    params = _rl_root(sft_run, tmp_path, rl__validate_every=5)
    (tmp_path / "data" / "prepared" / "val.parquet").unlink()
    r = _run(params, "rl")
    assert r.returncode == 2 and "val.parquet" in r.stderr and "Traceback" not in r.stderr


def test_schedule_and_config_checks(tmp_path):
    rl = RLConfig(num_steps=7, validate_every=3)
    assert [s for s in range(8) if due(s, rl)] == [0, 3, 6, 7]
    assert not any(due(s, RLConfig(num_steps=7)) for s in range(8))  # off by default
    check_validation_config(rl)
    with pytest.raises(ValueError, match=r"rl.validate_k = 4 samples .*rl.validate_temperature = 0"):
        check_validation_config(RLConfig(validate_every=1, validate_temperature=0.0))
    check_validation_config(RLConfig(validate_every=1, validate_temperature=0.0, validate_k=1))  # greedy is fine
    with pytest.raises(ValueError, match="rl.validate_temperature"):
        check_validation_config(RLConfig(validate_every=1, validate_temperature=-1.0))
    with pytest.raises(ValueError, match="rl.validate_every must be >= 0"):
        check_validation_config(RLConfig(validate_every=-1))
    with pytest.raises(ValueError, match="rl.validate_k must be >= 1"):
        check_validation_config(RLConfig(validate_every=1, validate_k=0))
    # the temperature is the only sampler setting validation changes
    rl = RLConfig(sampler=SamplerConfig(temperature=0.3, gen_length=4, steps=2, block_length=4), validate_temperature=0.9)
    from dare_core.training.rl.validation import validation_params

    assert validation_params(rl).temperature == 0.9 and validation_params(rl).steps == 2
    # the plot takes rows of any k
    rows = [{"step": 0, "k": 2, "prompts": 5, "mean@2": 0.1, "best@2": 0.3, "maj@2": 0.2},
            {"step": 4, "k": 2, "prompts": 5, "mean@2": 0.4, "best@2": 0.6, "maj@2": 0.5}]
    plot_validation(rows, tmp_path / "v.png")
    assert (tmp_path / "v.png").read_bytes().startswith(b"\x89PNG") and [p.name for p in tmp_path.iterdir()] == ["v.png"]
    # one validation (step 0 only): a plot all the same
    plot_validation(rows[:1], tmp_path / "v.png")
    assert (tmp_path / "v.png").read_bytes().startswith(b"\x89PNG")
    # a k that changed at a resume: each row under its own k
    assert validation_csv([rows[0], {**rows[1], "k": 3, "mean@3": 0.5, "best@3": 0.7, "maj@3": 0.6}]).splitlines() == [
        "step,metric,accuracy", "0,mean@2,0.1", "0,best@2,0.3", "0,maj@2,0.2", "4,mean@3,0.5", "4,best@3,0.7", "4,maj@3,0.6"]


def test_open_resumes_or_discards_the_record(tmp_path):
    """`open` at a resumed step keeps the validations up to it in validation.jsonl, validation.csv and
    the plot; a fresh run (step 0) starts all three empty, whatever an earlier run left."""
    from dare_core.training.rl.validation import RLValidator

    cfg = load_config(write_params(tmp_path / "params.yaml", tiny_params(tmp_path, rl__validate_every=0)))
    out = cfg.stage_dir("rl")
    out.mkdir(parents=True)
    earlier = [{"step": s, "k": 4, "prompts": 16, "mean@4": s / 10, "best@4": s / 5, "maj@4": s / 8, "nfe": 1, "time_s": 0.1}
               for s in (0, 2, 4)]
    for resume, kept in ((2, earlier[:2]), (0, [])):
        (out / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
        (out / "validation.csv").write_text(validation_csv(earlier))
        (out / "validation.png").write_bytes(b"an earlier run's plot")
        RLValidator(cfg, out).open(resume, writer=True)
        assert _jsonl(out / "validation.jsonl") == kept
        assert _csv_matches(out, kept)
        png = out / "validation.png"
        assert png.read_bytes().startswith(b"\x89PNG") if kept else not png.exists()


def test_validator_samples_through_the_rollout_engine(tmp_path):
    """RL validation decodes through the engine the loop built from rl.sampler.engine and its
    engine_args (here a recording one), never around it."""
    from conftest import make_tiny_llada
    from dare_core.models.tokenizer import load_tokenizer
    from dare_core.training.rl.validation import RLValidator
    from rollout_helpers import RecordingEngine

    cfg = load_config(write_params(tmp_path / "params.yaml", tiny_params(tmp_path, **DATA, rl__validate_every=1, rl__validate_k=2,
                                                                         rl__validate_prompts=3)))
    prepare(cfg)
    tok = load_tokenizer(cfg.data.tokenizer_dir)
    engine = RecordingEngine(make_tiny_llada(tok.vocab_size, tok.mask_token_id, tok.eos_token_id))
    validator = RLValidator(cfg, cfg.stage_dir("rl"))
    validator.open(0, writer=False)
    assert set(validator(engine, tok, 0)) == {"val/mean@2", "val/best@2", "val/maj@2"}
    assert engine.prompts == [tok.encode(r["prompt_text"]) for r in validator.rows for _ in range(2)]
