"""The preference stage switched off: `preference.enabled` false, or `auto` with no pairs to train on.

Preference optimisation is a side branch (nothing downstream reads its model), so a dataset that
yields no pairs (a user's file with string answers and no `data.preference_source`) turns the stage
off instead of failing `dvc repro`. An off stage still leaves every output dvc.yaml declares, so
DVC finds its metrics and plots: `metrics/preference.json` says `enabled: false` and why, the plot
CSVs hold their header only, metrics.jsonl no row, and the model and checkpoint folders hold a note
(ownership.STAGE_OFF_NOTE) instead of weights.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from dare_core.config import DareConfig
from dare_core.data.pairs import pairs_required, why_no_pairs
from dare_core.data.schema import DataError, read_rows
from dare_core.ownership import STAGE_OFF_NOTE, leave_stage_off_note
from dare_core.storage import atomic_dir, atomic_write_json
from dare_core.training.metrics import MetricsLogger
from dare_core.training.plots import STAGE_PLOTS
from dare_core.training.preflight import check_outputs, stage_writes

log = logging.getLogger(__name__)

SWITCH = "preference.enabled"


def pairs_file(cfg: DareConfig) -> Path:
    return Path(cfg.data.prepared_dir) / "preference.parquet"


def off_reason(cfg: DareConfig) -> Optional[str]:
    """Why the stage is off, or None when it runs. `enabled: true` with no pairs is an error."""
    enabled = cfg.preference.enabled
    if enabled is False:
        return f"{SWITCH} is false"
    path = pairs_file(cfg)
    if path.is_file() and read_rows(path, "preference"):
        return None
    if enabled is True:
        raise DataError(pairs_required(cfg, str(path)))
    return f"no preference pairs in {path}: {why_no_pairs(cfg)}"


def write_off_stage(cfg: DareConfig, reason: str, writer: bool) -> dict:
    """Leave the off stage's outputs (module docstring); the summary also goes to metrics/preference.json."""
    out_dir = cfg.stage_dir("preference")
    metrics_file = Path(cfg.run.metrics_dir) / "preference.json"
    model_dir = out_dir / "model"
    check_outputs(stage_writes(out_dir) + [metrics_file, model_dir], [], "the preference stage's outputs", [model_dir])
    summary = {"enabled": False, "reason": reason}
    if not writer:
        return summary
    log.info("preference stage off: %s. Set %s: true to require it (it then needs pairs).", reason, SWITCH)
    leave_stage_off_note(out_dir / "checkpoints", reason)
    plots = STAGE_PLOTS["preference"]
    MetricsLogger(out_dir, plot_keys=tuple(plots), pngs=plots).close()  # an empty record, header-only CSVs
    with atomic_dir(model_dir) as tmp:  # an earlier run's model is replaced only once the note is written
        (tmp / STAGE_OFF_NOTE).write_text(reason + "\n")
    atomic_write_json(metrics_file, summary)
    return summary
