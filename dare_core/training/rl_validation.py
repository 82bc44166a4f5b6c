"""In-loop validation of the RL policy on the held-out val split (`rl.validate_*`).

Every rank samples and grades its share of the val prompts (prompt i on rank i % ranks,
`validation_share`; `dare_core.eval.validation.sample_groups`); the prompts' scores are gathered and
put back in prompt order, so mean@k, best@k and maj@k are the one-rank numbers (a sample's noise
depends on its prompt's uid and its index only). The shares are padded to one length (a rank short
of a prompt samples one of its own again and drops the result) so that every rank runs the same
number of sampling calls: under ZeRO-3 every forward gathers the sharded weights collectively, which
a rank left out would hang. The numbers go into the RL metrics (on every rank) as `val/mean@k`,
`val/best@k`, `val/maj@k`; rank 0 writes `validation.jsonl` (one row per validation, rows after a
resumed step dropped) and `validation.png`, redrawn after each validation.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Optional

from dare_core.config import DareConfig, RLConfig
from dare_core.data.schema import read_rows
from dare_core.eval.validation import at_k_of_prompts, prompt_at_k, sample_groups
from dare_core.sampling.params import SamplingParams
from dare_core.training import engine as eng
from dare_core.training.metrics import rows_upto

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


def plot_validation(rows: list[dict], path: Path) -> None:
    """mean@k, best@k and maj@k against the RL step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = rows[-1]["k"]
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    for name in METRICS:
        # a row's keys carry its own k (validate_k may differ before a resume)
        points = [(r["step"], r[f"{name}@{r['k']}"]) for r in rows]
        ax.plot(*zip(*points), marker="o", markersize=3, label=f"{name}@{k}")
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"validation: {rows[-1]['prompts']} held-out prompts x {k} samples", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)  # never a half-written plot


class RLValidator:
    """Validation of one RL run. Every rank reads the val split (so that a missing or empty one fails
    on all ranks alike, before the model loads); every rank samples its share, the writer (rank 0,
    `open`) writes."""

    def __init__(self, cfg: DareConfig, out_dir: Path):
        rl = cfg.rl
        check_validation_config(rl)
        self.rl, self.seed, self.writer = rl, cfg.run.seed, False
        self.jsonl, self.png = Path(out_dir) / "validation.jsonl", Path(out_dir) / "validation.png"
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
            # always written (empty when validation is off): dvc.yaml tracks it as an output
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            self.history = rows_upto(self.jsonl, resume_step)
            self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in self.history))
            if self.history:
                plot_validation(self.history, self.png)
            elif self.png.exists():
                self.png.unlink()  # a fresh run: the plot of an earlier one would mislead

    def __call__(self, model, tokenizer, step: int) -> dict:
        """Validate `model` after `step` training steps if due (every rank calls it: each samples its
        share): the `val/...@k` metrics on every rank, {} when not due."""
        if not due(step, self.rl):
            return {}
        t0 = time.time()
        world, rank = eng.world_size(), eng.rank()
        share = validation_share(len(self.rows), rank, world)
        # a padding entry samples this rank's first prompt again (or, with none of its own, prompt 0)
        rows = [self.rows[i if i is not None else (share[0] if share[0] is not None else 0)] for i in share]
        groups, nfe = sample_groups(model, tokenizer, rows, self.params, self.rl.validate_k, self.seed, step,
                                    self.rl.sampler.batch_size, self.rl.reward, self.rl.reward_args)
        mine = [(i, prompt_at_k(g)) for i, g in zip(share, groups) if i is not None]
        parts = eng.all_gather_objects({"scores": mine, "nfe": nfe})
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
            plot_validation(self.history, self.png)
            log.info("validation at step %d (%d prompts x %d samples, %d rank(s), %.1fs): %s", step, len(self.rows), k,
                     world, row["time_s"], "  ".join(f"{key} {v:.3f}" for key, v in values.items()))
        return {f"val/{key}": v for key, v in values.items()}
