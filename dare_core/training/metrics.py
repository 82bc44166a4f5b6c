"""Metrics: JSON lines (the record), a CSV per plotted series (DVC plots), and TensorBoard."""
from __future__ import annotations

import csv
import json
from pathlib import Path


def rows_upto(path: Path, resume_step: int) -> list[dict]:
    """The JSON-lines rows of `path` a run resumed at `resume_step` keeps: those logged at or before
    it (later ones are redone); none for a fresh run (resume_step 0) or a missing file."""
    if resume_step <= 0 or not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) <= resume_step]


def last_logged(directory: Path, key: str):
    """The last value of `key` in a stage's metrics.jsonl (None if never logged): the summary of a run
    resumed at its last step, which trains nothing, repeats it."""
    path = Path(directory) / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((r[key] for r in reversed(rows) if key in r), None)


class MetricsLogger:
    """Append-only per-step metrics that survive a resume: rows after the resumed step are dropped."""

    def __init__(self, directory: Path, resume_step: int = 0, plot_keys: tuple = (), enabled: bool = True):
        self.dir = Path(directory)
        self.enabled = enabled
        self.plot_keys = plot_keys
        self.jsonl = self.dir / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        rows = rows_upto(self.jsonl, resume_step)
        self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self._rewrite_plots(rows)

    def _rewrite_plots(self, rows: list) -> None:
        for key in self.plot_keys:
            path = self.dir / f"{key}.csv"
            with path.open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["step", key])
                for r in rows:
                    if key in r:
                        w.writerow([r["step"], r[key]])

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key in self.plot_keys:
            if key in metrics:
                with (self.dir / f"{key}.csv").open("a", newline="") as f:
                    csv.writer(f).writerow([step, metrics[key]])
        tb = self._writer()
        if tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    tb.add_scalar(k, v, step)

    def _writer(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self._tb = False
        return self._tb or None

    def close(self) -> None:
        if self._tb:
            self._tb.close()
