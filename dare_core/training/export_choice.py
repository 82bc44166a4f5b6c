"""Which RL checkpoint the convert stage exports (`rl.export`).

RL can lose what it gained: on a task SFT had solved, a late run of updates took held-out accuracy
from 1.0 to 0.906, and exporting the last checkpoint handed that on to eval (issue 46). With
`rl.export: best` (the default) the export is the kept checkpoint whose in-loop validation scored
highest on `rl.export_metric` (mean@k, best@k or maj@k); a tie goes to the later step, which trained
longer for the same score. The RL stage keeps that checkpoint past `rl.keep_last` (`protected_tags`),
so it is still there when convert runs. Without a validation of a kept checkpoint (validation off,
or validate_every not landing on a save) the last checkpoint is exported, and the stage says why.
Step 0's validation (the SFT model) is a yardstick, not a candidate: it has no RL checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Optional

from dare_core.storage import read_records
from dare_core.training.checkpoint_io import META, latest_checkpoint

EXPORTS = ("best", "last")
EXPORT_METRICS = ("mean", "best", "maj")


def checkpoint_step(tag: str) -> Optional[int]:
    """The step of a checkpoint tag (`step00000040` -> 40), None for any other name."""
    digits = tag[len("step"):]
    return int(digits) if tag.startswith("step") and digits.isdigit() else None


def metric_value(row: dict, metric: str) -> Optional[float]:
    value = row.get(f"{metric}@{row.get('k')}")
    return float(value) if isinstance(value, (int, float)) else None


def best_validated_step(rows: list[dict], metric: str, steps: Collection[int]) -> Optional[int]:
    """The step among `steps` whose validation scored highest on `metric`@k; the later on a tie;
    None when no row validates one of them."""
    scored = [(metric_value(r, metric), r["step"]) for r in rows if r.get("step") in steps]
    scored = [(v, s) for v, s in scored if v is not None]
    return max(scored)[1] if scored else None


def best_validated_tag(rows: list[dict], metric: str, tags: Collection[str]) -> Optional[str]:
    """The checkpoint tag among `tags` whose step validated best (`best_validated_step`), or None."""
    by_step = {checkpoint_step(t): t for t in tags if checkpoint_step(t) is not None}
    best = best_validated_step(rows, metric, by_step)
    return None if best is None else by_step[best]


def protected_tags(rows: list[dict], metric: str, tags: Collection[str]) -> set[str]:
    """The tags that pruning must keep under `rl.export: best`: the best validated of `tags`."""
    best = best_validated_tag(rows, metric, tags)
    return {best} if best is not None else set()


@dataclass(frozen=True)
class ExportChoice:
    tag: str
    why: str


def export_choice(ckpt_dir: Path, validation: Path, export: str, metric: str) -> ExportChoice:
    """The checkpoint of `ckpt_dir` to export and a line saying why (module docstring)."""
    last, _ = latest_checkpoint(ckpt_dir)
    if export == "last":
        return ExportChoice(last, f"the last checkpoint, {last} (rl.export: last)")
    rows = read_records(validation)
    complete = [p.name for p in Path(ckpt_dir).glob("step*") if (p / META).is_file()]
    best_tag = best_validated_tag(rows, metric, complete)
    if best_tag is None:
        return ExportChoice(last, f"the last checkpoint, {last}: no kept checkpoint was validated "
                                  f"(rl.validate_every a multiple of rl.save_every makes rl.export: best choose)")
    values = {r["step"]: metric_value(r, metric) for r in rows}
    best, last_step = checkpoint_step(best_tag), checkpoint_step(last)
    k = next(r["k"] for r in rows if r["step"] == best)
    why = f"the best validated checkpoint, {best_tag}: {metric}@{k} {values[best]:.3f}"
    if best != last_step and values.get(last_step) is not None:
        why += f" (the last, step {last_step}: {values[last_step]:.3f}; rl.export: last exports it)"
    return ExportChoice(best_tag, why)
