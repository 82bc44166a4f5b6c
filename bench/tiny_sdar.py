"""A tiny SDAR (block diffusion) model trained from scratch on the embedded arithmetic task by DARE's
own stages (`dare stage prepare`, `sft`, `eval`, settings overridden from params.yaml), on a CPU in
minutes; `bench/eval_engines.py --train DIR` calls `train`.

The folder it writes is the SFT stage's export (config.json, safetensors, tokenizer files,
generation_config.json) plus `eval.parquet` (the held-out problems the model never saw, so the
folder alone is a `task` benchmark's data on another machine) and `training.json` (how it was made,
the eval stage's OpenCompass score, times).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from stamp import REPO, git_commit, hardware, utc_now, write_atomic

from dare_core.ownership import OUTPUT_MARKER

RUN = "tiny-sdar"
BLOCK = 4
# the decoding the folder is exported with (its generation_config.json's dare_sampler) and the eval stage
# scores it with: 4 answer digits + EOS rounded up to whole blocks of 4, greedy picks, threshold 0.9
EVAL_SAMPLER = {"gen_length": 8, "steps": 8, "block_length": BLOCK, "temperature": 0.0, "remasking": "low_confidence",
                "unmasking": "threshold", "threshold": 0.9, "cache": "block_kv", "batch_size": 250}
DEFAULT_STEPS, TINY_STEPS = 1200, 5
# --tiny (the CPU test): a two-layer narrow model on a few hundred problems
TINY_DATA = {"data.num_sft": 400, "data.num_rl": 64, "data.num_eval": 40, "data.num_preference": 64, "data.num_val": 16}
# the SDAR family's from-scratch shape (sdar.tiny_config's defaults, written out so that the model stays this
# one if they change): 4 layers, width 128, 4 heads of 32 with 2 key/value heads (grouped, as SDAR's), MLP 384
INIT = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 384, "max_position_embeddings": 128, "block_size": BLOCK}
TINY_INIT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "intermediate_size": 64}
# --tiny skips `eval`: OpenCompass's start alone takes ~20 s, and a 5-step model scores nothing
STAGES, TINY_STAGES = ("prepare", "sft", "eval"), ("prepare", "sft")


def stage_settings(workdir: Path, steps: int, tiny: bool) -> dict:
    """What the bench sets over params.yaml (the caller's --set comes after and wins)."""
    own = {
        "run.name": RUN, "run.seed": 0, "run.runs_dir": str(workdir / "runs"), "run.models_dir": str(workdir / "models"),
        "run.metrics_dir": str(workdir / "metrics"), "run.artifact_root": None,
        "data.prepared_dir": str(workdir / "data" / "prepared"), "data.tokenizer_dir": str(workdir / "data" / "tokenizer"),
        # no deliberately wrong demonstrations: with half of the carries forgotten, SFT learns a 50/50 split on
        # those digits, whose greedy pick is then decided by rounding, not by the model (no use for engine checks)
        "data.task_args.demo_error_rate": 0,
        "model.family": "sdar",
        # two heads of 64 instead learned far slower here (one seed each: 4% held-out accuracy after 1,500 steps,
        # against 62% after 400)
        "model.init": TINY_INIT if tiny else INIT,
        # block diffusion trains the response and its one EOS only: 4 digits + EOS
        "sft.pad_to": 5,
        "sft.max_steps": steps, "sft.log_every": max(1, min(100, steps)), "sft.save_every": 10**9,
        "eval.sampler": EVAL_SAMPLER, "eval.checkpoints": ["sft"], "eval.benchmarks": ["task"],
    }
    if tiny:
        own.update(TINY_DATA)
        own["sft.micro_batch_size"] = 16
        own["sft.optim.lr"], own["sft.optim.warmup_steps"] = 3.0e-3, 1
        own["launch.threads"] = 1  # a model this small gains nothing from a second thread's spin-waits
    return own


def run_stage(stage: str, sets: list[str], log: Path) -> float:
    """`dare stage <stage>` with the overrides, its output in `log`; its wall time. RuntimeError with the
    log's tail when it fails."""
    cmd = [sys.executable, "-m", "dare_core.cli", "stage", stage, "--restart", "--params", str(REPO / "params.yaml"),
           *(f"--set={s}" for s in sets)]
    # OpenMP threads that sleep instead of spinning while they wait: on this 2-core machine shared with other
    # jobs, an SFT step of the default model took 0.78 s spinning and 0.38 s sleeping beside one busy core
    # (0.20 s and 0.23 s with the machine to itself); the caller's own setting wins
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    t0 = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"dare stage {stage} failed (exit {code}); its log: {log}\n{tail}")
    return time.perf_counter() - t0


def train(folder: Path, workdir: Path, steps: Optional[int] = None, tiny: bool = False, extra: Optional[list[str]] = None,
          command: str = "") -> dict:
    """Train the model, write it to `folder` (replacing an earlier folder of this bench, never anything
    else) and return what training.json records."""
    folder, workdir = folder.resolve(), workdir.resolve()
    if folder.exists() and any(folder.iterdir()) and not (folder / "training.json").exists():
        raise SystemExit(f"{folder} exists and was not written by this bench (no training.json): choose another folder")
    steps = (TINY_STEPS if tiny else DEFAULT_STEPS) if steps is None else steps
    own = stage_settings(workdir, steps, tiny)
    sets = [f"{k}={json.dumps(v)}" for k, v in own.items()] + list(extra or [])
    workdir.mkdir(parents=True, exist_ok=True)
    commit, started = git_commit(), utc_now()
    seconds = {}
    for stage in TINY_STAGES if tiny else STAGES:
        print(f"[tiny_sdar] dare stage {stage} (log: {workdir / f'{stage}.log'}) ...", flush=True)
        seconds[stage] = round(run_stage(stage, sets, workdir / f"{stage}.log"), 1)
        print(f"[tiny_sdar] {stage}: {seconds[stage]} s", flush=True)
    metrics = workdir / "metrics"
    sft = json.loads((metrics / "sft.json").read_text())
    scores = json.loads((metrics / "eval.json").read_text())["sft"] if "eval" in seconds else None
    export = workdir / "runs" / RUN / "sft" / "model"
    config = json.loads((export / "config.json").read_text())
    record = {
        "what": f"tiny SDAR trained from scratch by bench/tiny_sdar.py (dare stage {', '.join(seconds)})",
        "commit": commit, "command": command, "date": started, "hardware": hardware(cpu_detail=True),
        "settings": sets, "sft_steps": steps, "stage_seconds": seconds, "sft_seconds": seconds["sft"],
        "total_seconds": round(sum(seconds.values()), 1), "final_loss": sft.get("final_loss"),
        "eval_sampler": json.loads((export / "generation_config.json").read_text()).get("dare_sampler"),
        "opencompass_accuracy": {k: v / 100 for k, v in scores.items()} if scores else None,
        "eval_items": _rows(workdir / "data" / "prepared" / "eval.parquet"),
        "model": {k: config.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                             "block_size", "mask_token_id", "eos_token_id", "torch_dtype")},
    }
    _publish(export, workdir / "data" / "prepared" / "eval.parquet", folder, record)
    record["size_bytes"] = sum(p.stat().st_size for p in folder.iterdir())
    write_atomic(folder / "training.json", json.dumps(record, indent=1) + "\n")
    return record


def _rows(parquet: Path) -> int:
    import pyarrow.parquet as pq

    return pq.read_metadata(parquet).num_rows


def _publish(export: Path, eval_file: Path, folder: Path, record: dict) -> None:
    """The export, the eval split and training.json into `folder`, swapped in whole: a run cut short
    leaves the previous folder as it was."""
    staging = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    # without the stage's ownership marker: no stage writes this folder
    shutil.copytree(export, staging, ignore=shutil.ignore_patterns(OUTPUT_MARKER))
    shutil.copy2(eval_file, staging / "eval.parquet")
    write_atomic(staging / "training.json", json.dumps(record, indent=1) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
