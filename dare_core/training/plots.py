"""PNG line plots of the training stages' logged series, drawn in one place and written atomically.

`line_plot` draws one or more (step, value) series with a marker on every point, so that a series of
one point shows; the x axis has whole-step ticks and, for a single step, spans step - 1 .. step + 1;
a constant series gets a y axis around its value, a fraction one 0 .. 1. Non-finite values are left
out (and counted in a note). The PNG is rendered in memory and moved into place in one rename
(`dare_core.storage.atomic_write_bytes`), so a reader never sees a half-written file.

`STAGE_PLOTS` holds each stage's plots: title and axis labels, the same as in dvc.yaml's `plots:`
entries (tests/test_dvc_plots.py checks that they agree), so the PNG beside a run and `dvc plots show`
say the same thing. The stage loops hand them to `dare_core.training.metrics.MetricsLogger`, which
redraws `<key>.png` beside `<key>.csv` at the end of a logged step (`PlotThrottle`).
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from dare_core.storage import atomic_write_bytes

Point = tuple[float, float]


@dataclass(frozen=True)
class PlotSpec:
    title: str
    x_label: str
    y_label: str
    fraction: bool = False  # values in [0, 1]: the y axis shows all of 0 .. 1


# The SFT loss (dare_core/algorithms/sft.py) is a negative ELBO in nats (log-softmax), averaged per
# answer token (sft.loss_norm answer_length or token) or per answer (batch).
SFT_LOSS_UNITS = {"answer_length": "nats per answer token", "token": "nats per answer token", "batch": "nats per answer"}


def sft_plots(loss_norm: str = "answer_length") -> dict[str, PlotSpec]:
    return {"loss": PlotSpec("SFT training loss", "SFT step", f"negative ELBO ({SFT_LOSS_UNITS.get(loss_norm, 'nats')})")}


STAGE_PLOTS: dict[str, dict[str, PlotSpec]] = {
    "sft": sft_plots(),
    # dare_core/algorithms/preference.py: loss = -log sigmoid(margin), margin = beta x the ELBO
    # differences (policy - reference, chosen - rejected); both are means over the step's pairs
    "preference": {
        "loss": PlotSpec("preference loss", "preference step", "-log sigmoid(margin), mean per pair (nats)"),
        "reward_margin": PlotSpec("preference implicit reward margin", "preference step",
                                  "beta x ELBO margin, mean per pair (nats)"),
        "reward_accuracy": PlotSpec("preference reward accuracy", "preference step",
                                    "fraction of pairs with margin > 0", fraction=True),
    },
    # dare_core/algorithms/rollout.py: the mean of the rollouts' rewards, the share graded correct
    "rl": {
        "reward": PlotSpec("RL reward", "RL step", "mean reward per rollout"),
        "accuracy": PlotSpec("RL accuracy", "RL step", "fraction of rollouts correct", fraction=True),
    },
}

# rl/validation.png and rl/validation.csv (dare_core/training/rl/validation.py)
VALIDATION = PlotSpec("RL validation on held-out prompts", "RL step", "fraction of prompts correct", fraction=True)


def x_limits(xs: Sequence[float]) -> tuple[float, float]:
    """The x axis: the steps plus a margin; one step (or none) spans step - 1 .. step + 1."""
    if not xs:
        return 0.0, 1.0
    lo, hi = min(xs), max(xs)
    if hi - lo < 1:
        return lo - 1, hi + 1
    pad = 0.03 * (hi - lo)
    return lo - pad, hi + pad


def y_limits(ys: Sequence[float], fraction: bool) -> Optional[tuple[float, float]]:
    """The y axis: 0 .. 1 (with a margin) for a fraction, around the value for a constant series,
    None (matplotlib's own) otherwise."""
    if fraction:
        lo, hi = min([0.0, *ys]), max([1.0, *ys])
        pad = 0.03 * (hi - lo)
        return lo - pad, hi + pad
    if not ys:
        return None
    lo, hi = min(ys), max(ys)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        pad = max(0.1 * abs(hi), 0.1)
        return lo - pad, hi + pad
    return None


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def figure(series: Mapping[str, Sequence[Point]], spec: PlotSpec):
    """A matplotlib Figure (no pyplot: no global state, any thread) of `series`
    ({label: [(step, value), ...]}; one label: no legend, the last value in a corner)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5.0, 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs_all: list[float] = []
    ys_all: list[float] = []
    dropped = 0
    for label, points in series.items():
        finite = [(float(x), float(y)) for x, y in points if math.isfinite(float(y))]
        dropped += len(points) - len(finite)
        xs_all += [float(x) for x, _ in points]
        if finite:
            xs, ys = zip(*finite)
            ys_all += ys
            ax.plot(xs, ys, marker="o", markersize=5 if len(finite) < 30 else 2.5, linewidth=1.3, label=label)
    ax.set_xlim(*x_limits(xs_all))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    limits = y_limits(ys_all, spec.fraction)
    if limits is not None:
        ax.set_ylim(*limits)
    ax.set_title(spec.title, fontsize=11)
    ax.set_xlabel(spec.x_label, fontsize=9)
    ax.set_ylabel("\n".join(textwrap.wrap(spec.y_label, 34)), fontsize=9)
    ax.grid(alpha=0.3)
    notes = []
    if len(series) > 1:
        ax.legend(fontsize=8)
    else:
        last = next((p for p in reversed(next(iter(series.values()), [])) if math.isfinite(float(p[1]))), None)
        if last is not None:
            notes.append(f"step {int(last[0])}: {_fmt(float(last[1]))}")
    if dropped:
        notes.append(f"{dropped} non-finite value(s) not shown")
    if not ys_all:
        notes.append("no finite values yet")
    if notes:
        ax.text(0.99, 0.98, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=8,
                bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "linewidth": 0})
    return fig


def render_png(series: Mapping[str, Sequence[Point]], spec: PlotSpec) -> bytes:
    buf = io.BytesIO()
    figure(series, spec).savefig(buf, format="png")
    return buf.getvalue()


def line_plot(path: Path, series: Mapping[str, Sequence[Point]], spec: PlotSpec) -> None:
    """Draw `series` into the PNG `path`, replacing it in one rename."""
    atomic_write_bytes(path, render_png(series, spec))


class PlotThrottle:
    """When to redraw: at the first chance, then only once the time since the last drawing is
    1 / `share` times what that drawing took, so that drawing costs at most about `share` of the
    run's wall time (a drawing takes ~0.1 s; an RL step of the embedded run ~0.6 s). `share` None:
    every time. `force` (the run's end) always draws."""

    def __init__(self, share: Optional[float]):
        self.share = share
        self._cost = 0.0
        self._end: Optional[float] = None

    def due(self, force: bool = False) -> bool:
        if force or self.share is None or self._end is None:
            return True
        return time.monotonic() - self._end >= self._cost / self.share

    def record(self, started: float) -> None:
        self.spent(time.monotonic() - started)

    def spent(self, seconds: float) -> None:
        """A drawing that took `seconds` (of another process, say) has just ended."""
        self._end = time.monotonic()
        self._cost = seconds


log = logging.getLogger(__name__)

# one drawing: the PNG's path, its series and its PlotSpec
PlotJob = tuple[Path, Mapping[str, Sequence[Point]], PlotSpec]


class PlotProcess:
    """Draws PNGs in a child process (`python -m dare_core.training.plots`), so that rank 0 of
    several does not draw while the others wait for it at their next collective: on 4 GPUs the end
    of rank 0's first logged RL step (the first drawing, matplotlib's import with it, and
    TensorBoard's first import) held every rank 0.7 s. One drawing is in flight at a time
    (`in_flight`). A child that died is reported once, and the caller draws in its own process from
    then on (`alive` turns False)."""

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "dare_core.training.plots"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env)
        self.in_flight = False
        self.alive = True

    def submit(self, jobs: list[PlotJob]) -> bool:
        """Hand `jobs` to the child (not while `in_flight`); False (and `alive` off) if it is gone."""
        line = json.dumps([{"path": str(path), "series": {k: list(v) for k, v in series.items()},
                            "spec": asdict(spec)} for path, series, spec in jobs])
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return self._lost()
        self.in_flight = True
        return True

    def finished(self, wait: bool = False) -> Optional[float]:
        """The seconds of the drawing in flight once it has ended (waiting for it with `wait`),
        else None."""
        if not self.in_flight:
            return None
        if not wait and not select.select([self._proc.stdout], [], [], 0)[0]:
            return None
        reply = self._proc.stdout.readline()
        self.in_flight = False
        if not reply:
            self._lost()
            return None
        return float(reply)

    def close(self) -> None:
        """Wait for the drawing in flight, then end the child."""
        if self.alive:
            self.finished(wait=True)
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _lost(self) -> bool:
        if self.alive:
            log.warning("the PNG drawing process ended (exit code %s): rank 0 draws the plots itself from here on",
                        self._proc.poll())
        self.alive, self.in_flight = False, False
        return False


def _serve() -> None:
    """The child of `PlotProcess`: a JSON line of drawings on stdin at a time; once it is drawn,
    a line with the seconds it took on stdout. It ends when its parent closes the pipe (or dies), not
    on the Ctrl-C that reaches the whole process group."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for line in sys.stdin:
        started = time.perf_counter()
        for job in json.loads(line):
            series = {k: [tuple(p) for p in v] for k, v in job["series"].items()}
            line_plot(Path(job["path"]), series, PlotSpec(**job["spec"]))
        print(f"{time.perf_counter() - started:.6f}", flush=True)


if __name__ == "__main__":
    _serve()
