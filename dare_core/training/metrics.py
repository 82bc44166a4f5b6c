"""Metrics: JSON lines (the record), a CSV per plotted series (DVC plots), a PNG per plotted series
(`dare_core.training.plots`), and TensorBoard."""
from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

from tqdm import tqdm

from dare_core.storage import read_records
from dare_core.training.plots import PlotProcess, PlotSpec, PlotThrottle, line_plot

# the share of a run's wall time drawing PNGs may take (`PlotThrottle`)
PLOT_TIME_SHARE = 0.05
# set (to 1) by the pipeline's stage task: print one line per logged step
LOG_STEPS_ENV = "DARE_LOG_STEPS"


def write_rows(path: Path, rows: list[dict]) -> None:
    """Rewrite the JSON-lines record `path` with `rows`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def end_without_rows(path: Path) -> None:
    """A finished stage's record that got no row holds one blank line, not nothing: DVC warns at
    every `dvc repro` that an empty output is empty, and every reader of these records skips blank
    lines. Only then: a record with rows has no blank line for a simpler reader to trip on."""
    if not path.is_file() or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n")


def rows_upto(path: Path, resume_step: int) -> list[dict]:
    """The JSON-lines rows of `path` a run resumed at `resume_step` keeps: those logged at or before
    it (later ones are redone); none for a fresh run (resume_step 0) or a missing file."""
    if resume_step <= 0:
        return []
    return [r for r in read_records(path) if r.get("step", 0) <= resume_step]


def last_logged(directory: Path, key: str):
    """The last value of `key` in a stage's metrics.jsonl (None if never logged): the summary of a run
    resumed at its last step, which trains nothing, repeats it."""
    rows = read_records(Path(directory) / "metrics.jsonl")
    return next((r[key] for r in reversed(rows) if key in r), None)


class MetricsLogger:
    """Append-only per-step metrics that survive a resume: rows after the resumed step are dropped.

    `plot_keys`: the keys written to `<key>.csv` (DVC plots). `pngs`: {key: PlotSpec}, the keys drawn
    to `<key>.png` at the end of a logged step that logs them (at most `png_share` of the wall time:
    `PlotThrottle`; None: every such step) and at `close`. A fresh run removes the PNGs of an earlier
    one; a resumed run redraws them from the rows it keeps.

    `rank_of_several` (rank 0 of a multi-rank run, whom the others wait for at their next
    collective): the drawings go to a child process (`PlotProcess`), and TensorBoard's writer is
    made now rather than at the first logged step (its first import takes about a second)."""

    def __init__(self, directory: Path, resume_step: int = 0, plot_keys: tuple = (), enabled: bool = True,
                 pngs: Optional[Mapping[str, PlotSpec]] = None, png_share: Optional[float] = PLOT_TIME_SHARE,
                 rank_of_several: bool = False):
        self.dir = Path(directory)
        self.enabled = enabled
        self.plot_keys = plot_keys
        self.pngs = dict(pngs or {})
        self.jsonl = self.dir / "metrics.jsonl"
        self._tb = None
        self._series: dict[str, list] = {key: [] for key in self.pngs}
        self._stale: set[str] = set()  # keys logged since their PNG was last drawn
        self._throttle = PlotThrottle(png_share)
        self._drawer: Optional[PlotProcess] = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        rows = rows_upto(self.jsonl, resume_step)
        write_rows(self.jsonl, rows)
        self._rewrite_plots(rows)
        for key in self.pngs:
            self._series[key] = [(r["step"], r[key]) for r in rows if key in r]
            if self._series[key]:
                self._stale.add(key)
            else:
                (self.dir / f"{key}.png").unlink(missing_ok=True)  # an earlier run's plot would mislead
        self.draw(force=True)
        if rank_of_several:
            self._writer()
            if self.pngs:
                self._drawer = PlotProcess()

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
        for key in self.pngs:
            if key in metrics:  # the value as metrics.jsonl keeps it: a resumed run redraws the same
                self._series[key].append((step, row[key]))
                self._stale.add(key)
        self.draw()
        if os.environ.get(LOG_STEPS_ENV):
            self._print_step(row)
        tb = self._writer()
        if tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    tb.add_scalar(k, v, step)

    def _print_step(self, row: dict) -> None:
        """One console line per logged step (the pipeline's Prefect task forwards it; a progress bar
        alone shows only its last frame there): plotted keys first."""
        keys = [k for k in self.plot_keys if k in row] + [k for k in row if k != "step" and k not in self.plot_keys]
        cells = [f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in keys
                 if isinstance(row[k], (int, float, str))]
        line = f"{self.dir.name} step {row['step']}: " + " ".join(cells)
        tqdm.write(line[:400], file=sys.stdout)

    def _writer(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self._tb = False
        return self._tb or None

    def draw(self, force: bool = False) -> None:
        """Redraw the PNGs of the keys logged since their last drawing, if `PlotThrottle` says so."""
        drawer = self._drawer
        if drawer is not None and drawer.in_flight:
            seconds = drawer.finished(wait=force)
            if seconds is not None:
                self._throttle.spent(seconds)
            if drawer.in_flight:  # the keys stay stale: drawn at a later step, or at close
                return
        if not self.enabled or not self._stale or not self._throttle.due(force):
            return
        jobs = [(self.dir / f"{key}.png", {key: list(self._series[key])}, self.pngs[key]) for key in sorted(self._stale)]
        self._stale.clear()
        if drawer is not None and drawer.alive and not force and drawer.submit(jobs):
            return
        started = time.monotonic()
        for path, series, spec in jobs:
            line_plot(path, series, spec)
        self._throttle.record(started)

    def close(self) -> None:
        if self.enabled:
            end_without_rows(self.jsonl)
        self.draw(force=True)  # the last logged step, whatever the throttle skipped
        if self._drawer is not None:
            self._drawer.close()
            self._drawer = None
        if self._tb:
            self._tb.close()
