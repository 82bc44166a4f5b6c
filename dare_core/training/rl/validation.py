"""In-loop validation of the RL policy on the held-out val split (`rl.validate_*`).

Every rank samples and grades its share of the val prompts (prompt i on rank i % ranks,
`validation_share`; `dare_core.eval.validation.sample_groups`); the prompts' scores are gathered and
put back in prompt order, so mean@k, best@k and maj@k are the one-rank numbers (a sample's noise
depends on its prompt's uid and its index only). The shares are padded to one length (a rank short
of a prompt samples one of its own again and drops the result) so that every rank runs the same
number of sampling calls: under ZeRO-3 every forward gathers the sharded weights collectively, which
a rank left out would hang. The numbers go into the RL metrics (on every rank) as `val/mean@k`,
`val/best@k`, `val/maj@k`; rank 0 writes `validation.jsonl` (one row per validation, rows after a
resumed step dropped), `validation.csv` (a row per validation and metric: `step,metric,accuracy`, the
curve `dvc plots` draws, dvc.yaml's rl stage) and `validation.png` (`dare_core.training.plots`), both
rewritten in one rename after each validation; a fresh run starts them empty.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import time
from pathlib import Path
from typing import Optional

from dare_core.config import DareConfig, RLConfig
from dare_core.data.schema import read_rows
from dare_core.eval.validation import at_k_of_prompts, prompt_at_k, sample_groups
from dare_core.sampling.params import SamplingParams
from dare_core.storage import atomic_write_text
from dare_core.training import engine as eng
from dare_core.training.metrics import end_without_rows, rows_upto, write_rows
from dare_core.training.plots import VALIDATION, line_plot

log = logging.getLogger(__name__)

METRICS = ("mean", "best", "maj")


def validation_params(rl: RLConfig) -> SamplingParams:
    """rl.sampler's decoding at rl.validate_temperature."""
    return dataclasses.replace(rl.sampler, temperature=rl.validate_temperature)


def check_validation_config(rl: RLConfig) -> None:
    """Raise ValueError, naming the key, for settings validation cannot run with."""
    for key in ("validate_every", "validate_prompts"):
        if getattr(rl, key) < 0:
            raise ValueError(f"rl.{key} must be >= 0, got {getattr(rl, key)}")
    if rl.validate_every == 0:
        return
    if rl.validate_k < 1:
        raise ValueError(f"rl.validate_k must be >= 1, got {rl.validate_k}")
    try:
        params = validation_params(rl)
    except ValueError as exc:
        raise ValueError(f"rl.validate_temperature: {exc}") from None
    if rl.validate_k > 1 and not params.stochastic:
        raise ValueError(f"rl.validate_k = {rl.validate_k} samples per prompt with rl.validate_temperature = "
                         f"{rl.validate_temperature} would all be the same response: use a temperature > 0, "
                         f"or validate_k: 1 for greedy validation")


def due(step: int, rl: RLConfig) -> bool:
    """Whether to validate after `step` training steps: at 0 (the SFT model), every validate_every
    steps and at the last step."""
    return rl.validate_every > 0 and (step % rl.validate_every == 0 or step == rl.num_steps)


def validation_share(n_prompts: int, rank: int, world: int) -> list[Optional[int]]:
    """The val prompts rank `rank` of `world` samples: i, i + world, ... (every prompt on exactly one
    rank), padded to ceil(n_prompts / world) entries with None (a rank short of a prompt samples one
    again and drops the result), so that every rank makes the same number of sampling calls."""
    mine: list[Optional[int]] = list(range(rank, n_prompts, world))
    return mine + [None] * (-(-n_prompts // world) - len(mine))


def validation_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{"mean@k": [(step, value), ...], "best@k": ..., "maj@k": ...}, k the last row's (a row's own
    keys carry its k: validate_k may differ before a resume)."""
    k = rows[-1]["k"] if rows else "k"
    return {f"{name}@{k}": [(r["step"], r[f"{name}@{r['k']}"]) for r in rows] for name in METRICS}


def validation_csv(rows: list[dict]) -> str:
    """validation.csv: `step,metric,accuracy`, a row per validation and metric (long form: one
    `dvc plots` curve per metric, `.dvc/plots/dare_validation.json`)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "metric", "accuracy"])
    for r in rows:
        for name in METRICS:
            w.writerow([r["step"], f"{name}@{r['k']}", r[f"{name}@{r['k']}"]])
    return buf.getvalue()


def plot_validation(rows: list[dict], path: Path) -> None:
    """mean@k, best@k and maj@k against the RL step, replacing `path` in one rename."""
    title = f"RL validation: {rows[-1]['prompts']} held-out prompts x {rows[-1]['k']} samples"
    line_plot(path, validation_series(rows), dataclasses.replace(VALIDATION, title=title))


class RLValidator:
    """Validation of one RL run. Every rank reads the val split (so that a missing or empty one fails
    on all ranks alike, before the model loads); every rank samples its share, the writer (rank 0,
    `open`) writes."""

    def __init__(self, cfg: DareConfig, out_dir: Path):
        rl = cfg.rl
        check_validation_config(rl)
        self.rl, self.seed, self.writer = rl, cfg.run.seed, False
        out_dir = Path(out_dir)
        self.jsonl, self.csv, self.png = out_dir / "validation.jsonl", out_dir / "validation.csv", out_dir / "validation.png"
        self.params = validation_params(rl)
        self.rows: list[dict] = []
        if rl.validate_every > 0:
            path = Path(cfg.data.prepared_dir) / "val.parquet"
            self.rows = read_rows(path, "val")
            if not self.rows:
                raise ValueError(f"rl.validate_every = {rl.validate_every} but {path} has no prompts "
                                 f"(data.num_val = 0?): prepare a val split or set rl.validate_every: 0")
            if rl.validate_prompts:
                self.rows = self.rows[:rl.validate_prompts]
        self.history: list[dict] = []

    def open(self, resume_step: int, writer: bool) -> None:
        """Start (or, at `resume_step` > 0, resume) the record: validations after `resume_step` are
        dropped. `writer`: this rank writes (rank 0)."""
        self.writer = writer
        if writer:
            # always written (empty when validation is off): dvc.yaml tracks them as outputs
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            self.history = rows_upto(self.jsonl, resume_step)
            write_rows(self.jsonl, self.history)
            if self.rl.validate_every <= 0:
                end_without_rows(self.jsonl)  # no validation will add a row
            atomic_write_text(self.csv, validation_csv(self.history))
            if self.history:
                plot_validation(self.history, self.png)
            else:
                self.png.unlink(missing_ok=True)  # a fresh run: the plot of an earlier one would mislead

    def __call__(self, rollout_engine, tokenizer, step: int) -> dict:
        """Validate the policy through `rollout_engine` (rl.sampler.engine) after `step`
        training steps if due (every rank calls it: each samples its share): the `val/...@k` metrics
        on every rank, {} when not due."""
        if not due(step, self.rl):
            return {}
        t0 = time.time()
        world, rank = eng.world_size(), eng.rank()
        share = validation_share(len(self.rows), rank, world)
        # a padding entry samples this rank's first prompt again (or, with none of its own, prompt 0)
        rows = [self.rows[i if i is not None else (share[0] if share[0] is not None else 0)] for i in share]
        groups, nfe = sample_groups(rollout_engine, tokenizer, rows, self.params, self.rl.validate_k, self.seed, step,
                                    self.rl.sampler.batch_size, self.rl.reward, self.rl.reward_args,
                                    self.rl.reward_errors_allowed)
        mine = [(i, prompt_at_k(g)) for i, g in zip(share, groups) if i is not None]
        parts = eng.all_gather_objects({"scores": mine, "nfe": nfe}, every_rank=True)  # split over every rank
        graded = [item for part in parts for item in part["scores"]]
        if sorted(i for i, _ in graded) != list(range(len(self.rows))):  # every prompt on exactly one rank
            raise RuntimeError(f"validation: the ranks graded prompts {sorted(i for i, _ in graded)} of {len(self.rows)}")
        scores = dict(graded)
        k = self.rl.validate_k
        res = at_k_of_prompts([scores[i] for i in range(len(self.rows))], k)
        values = {f"{name}@{k}": res[f"{name}@{k}"] for name in METRICS}
        # nfe: the forward passes of all ranks together (padding included)
        row = {"step": step, **{key: round(v, 6) for key, v in values.items()}, "k": k, "prompts": len(self.rows),
               "nfe": sum(part["nfe"] for part in parts), "time_s": round(time.time() - t0, 3)}
        self.history.append(row)
        if self.writer:
            with self.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
            atomic_write_text(self.csv, validation_csv(self.history))
            plot_validation(self.history, self.png)
            log.info("validation at step %d (%d prompts x %d samples, %d rank(s), %.1fs): %s", step, len(self.rows), k,
                     world, row["time_s"], "  ".join(f"{key} {v:.3f}" for key, v in values.items()))
        return {f"val/{key}": v for key, v in values.items()}
