"""The training stages' PNG plots (dare_core/training/plots.py, MetricsLogger): a series of one point
shows (a marker, an x axis of whole steps around it, a y axis around its value), every point lies
inside the axes, a PNG is replaced in one rename (a concurrent reader only ever sees whole files),
it is there after a logged step and follows a resume, and the SFT stage writes loss.png."""
from __future__ import annotations

import json
import math
import random
import subprocess
import threading

import matplotlib.image
import pytest

from dare_core.config import load_config
from dare_core.data.prepare import prepare
from dare_core.training import plots
from dare_core.training.metrics import MetricsLogger
from dare_core.training.plots import STAGE_PLOTS, VALIDATION, PlotSpec, PlotThrottle, figure, line_plot, render_png
from pipeline_helpers import dare, tiny_params, worker_env, write_params

LOSS = STAGE_PLOTS["sft"]["loss"]
PNG_END = b"IEND\xaeB`\x82"  # the last chunk of every complete PNG


def _whole_png(data: bytes) -> bool:
    return data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(PNG_END)


def _no_tmp(folder) -> bool:
    return not [p.name for p in folder.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]


def test_one_point_shows():
    for step, value in ((0, 0.0), (1, 2.3), (3000, -0.7), (40, 1e-9)):
        ax = figure({"loss": [(step, value)]}, LOSS).axes[0]
        (lo, hi), (ylo, yhi) = ax.get_xlim(), ax.get_ylim()
        assert lo <= step - 1 + 1e-9 and hi >= step + 1 - 1e-9 and hi - lo <= 3  # around the step, not +-0.045
        assert ylo < value < yhi and yhi - ylo >= 0.1
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks) and step in ticks
        (line,) = ax.get_lines()
        assert line.get_marker() == "o" and line.get_markersize() > 0 and list(line.get_xdata()) == [step]


def test_every_point_inside_the_axes():
    rng = random.Random(0)
    for trial in range(40):
        n = rng.choice([1, 2, 3, 10, 200])
        start = rng.randint(0, 5000)
        steps = sorted(rng.sample(range(start, start + 10 * n + 1), n))
        scale = 10 ** rng.uniform(-6, 4)
        values = [rng.uniform(-1, 1) * scale for _ in steps] if trial % 4 else [scale] * n  # some constant
        spec = PlotSpec("t", "step", "v", fraction=trial % 5 == 0)
        ax = figure({"v": list(zip(steps, values))}, spec).axes[0]
        (lo, hi), (ylo, yhi) = ax.get_xlim(), ax.get_ylim()
        assert lo < min(steps) and max(steps) < hi, (trial, lo, hi)
        assert ylo < min(values) and max(values) < yhi and yhi > ylo, (trial, ylo, yhi)
        if spec.fraction:
            assert ylo < 0 and yhi > 1  # the whole 0 .. 1 range
        assert all(float(t).is_integer() for t in ax.get_xticks())


def test_non_finite_values_are_left_out_and_said():
    ax = figure({"loss": [(1, 2.0), (2, math.nan), (3, math.inf), (4, 1.0)]}, LOSS).axes[0]
    assert list(ax.get_lines()[0].get_xdata()) == [1, 4]
    assert any("2 non-finite" in t.get_text() for t in ax.texts)
    ax = figure({"loss": [(5, math.nan)]}, LOSS).axes[0]  # nothing finite: still an axis around the step
    assert ax.get_xlim()[0] <= 4 and ax.get_xlim()[1] >= 6 and any("no finite" in t.get_text() for t in ax.texts)


def test_several_series_get_a_legend_and_labels():
    series = {"mean@4": [(0, 0.2), (20, 0.5)], "best@4": [(0, 0.4), (20, 0.7)], "maj@4": [(0, 0.3)]}
    ax = figure(series, VALIDATION).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(series)
    assert ax.get_title() == VALIDATION.title and ax.get_xlabel() == "RL step"
    assert ax.get_ylabel().replace("\n", " ") == VALIDATION.y_label


def test_a_concurrent_reader_only_sees_whole_pngs(tmp_path):
    path = tmp_path / "loss.png"
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                seen.append(path.read_bytes())
            except FileNotFoundError:
                pass

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(1, 16):
            line_plot(path, {"loss": [(s, 1.0 / s) for s in range(1, 10 * n)]}, LOSS)
    finally:
        stop.set()
        reader.join()
    assert seen and all(_whole_png(b) for b in seen), [len(b) for b in seen if not _whole_png(b)]
    assert _no_tmp(tmp_path) and matplotlib.image.imread(path).ndim == 3


def test_logger_draws_after_each_logged_step_and_follows_a_resume(tmp_path):
    out = tmp_path / "sft"
    (out).mkdir()
    (out / "loss.png").write_bytes(b"an earlier run's plot")
    logger = MetricsLogger(out, plot_keys=("loss",), pngs={"loss": LOSS}, png_share=None)
    assert not (out / "loss.png").exists()  # a fresh run: the earlier plot is gone
    drawn = []
    for step in (10, 20, 30, 40):
        logger.log(step, {"loss": 4.0 / step, "lr": 1e-3})
        png = (out / "loss.png").read_bytes()
        assert _whole_png(png) and png not in drawn and _no_tmp(out)  # a new, whole plot per logged step
        drawn.append(png)
    logger.log(40, {"time/export_s": 1.0})  # a row without the plotted key: nothing redrawn
    assert (out / "loss.png").read_bytes() == drawn[-1]
    logger.close()
    assert (out / "loss.csv").read_text().splitlines() == ["step,loss", "10,0.4", "20,0.2", "30,0.13333333333333333", "40,0.1"]
    # resumed at step 20: the plot is redrawn from the rows kept, the same as a plot of them alone
    MetricsLogger(out, resume_step=20, plot_keys=("loss",), pngs={"loss": LOSS}, png_share=None).close()
    assert (out / "loss.png").read_bytes() == render_png({"loss": [(10, 0.4), (20, 0.2)]}, LOSS)
    assert (out / "loss.csv").read_text().splitlines() == ["step,loss", "10,0.4", "20,0.2"]


def test_throttled_logger_still_ends_with_the_last_step(tmp_path, monkeypatch):
    """With the default share, logged steps that come too fast are not all drawn, but the first is
    and `close` draws the last."""
    clock = [0.0]
    monkeypatch.setattr(plots.time, "monotonic", lambda: clock[0])
    calls = []

    def fake_plot(path, series, spec):
        calls.append(list(series["loss"]))
        clock[0] += 0.1  # a drawing takes 0.1 s

    monkeypatch.setattr("dare_core.training.metrics.line_plot", fake_plot)
    logger = MetricsLogger(tmp_path, plot_keys=("loss",), pngs={"loss": LOSS}, png_share=0.05)
    for step in range(1, 101):
        logger.log(step, {"loss": 1.0 / step})
        clock[0] += 0.5  # a step takes 0.5 s: a drawing fits every 2 s, every 4th step or so
    logger.close()
    assert calls[0] == [(1, 1.0)] and calls[-1][-1] == (100, 0.01)
    assert 15 <= len(calls) <= 30  # about 5 % of the time drawing


def test_throttle_share():
    t = PlotThrottle(None)
    assert t.due() and t.due()
    t = PlotThrottle(0.5)
    assert t.due()  # never drawn
    t.record(plots.time.monotonic() - 10.0)  # the drawing took 10 s: the next one in 20 s
    assert not t.due() and t.due(force=True)


@pytest.mark.parametrize("stage", ["preference", "rl"])
def test_every_stage_plot_is_a_fraction_or_has_units(stage):
    for key, spec in STAGE_PLOTS[stage].items():
        assert spec.fraction == ("accuracy" in key)
        assert "step" in spec.x_label and spec.title and spec.y_label


def test_sft_stage_writes_loss_png(tmp_path):
    params = write_params(tmp_path / "params.yaml", tiny_params(tmp_path, sft__max_steps=4, sft__log_every=2, sft__save_every=4))
    prepare(load_config(params))
    r = subprocess.run(dare("stage", "sft", "--params", str(params)), env=worker_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "runs" / "t" / "sft"
    png = (out / "loss.png").read_bytes()
    assert _whole_png(png) and matplotlib.image.imread(out / "loss.png").shape[:2] == (340, 500)
    losses = [(row["step"], row["loss"]) for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert [s for s, _ in losses] == [2, 4]
    assert png == render_png({"loss": losses}, STAGE_PLOTS["sft"]["loss"])  # the last logged step is drawn
    assert _no_tmp(out)


def _log_steps(logger: MetricsLogger, steps) -> None:
    for step in steps:
        logger.log(step, {"loss": 4.0 / step})


def test_drawing_aside_writes_the_same_pngs_without_the_logger_waiting(tmp_path):
    """Rank 0 of several hands its drawings to a child process: a logged step returns with the
    drawing still in flight, and the PNGs at the end are those drawn in the process itself."""
    inline, aside = tmp_path / "inline", tmp_path / "aside"
    ref = MetricsLogger(inline, plot_keys=("loss",), pngs={"loss": LOSS}, png_share=None)
    _log_steps(ref, (10, 20, 30))
    ref.close()
    logger = MetricsLogger(aside, plot_keys=("loss",), pngs={"loss": LOSS}, png_share=None, rank_of_several=True)
    drawer = logger._drawer
    assert logger._tb is not None  # TensorBoard's writer made before the first step (False: not installed)
    logger.log(10, {"loss": 0.4})
    assert drawer.in_flight  # handed over; the step did not wait for it
    _log_steps(logger, (20, 30))  # (steps logged while a drawing is in flight are drawn later)
    logger.close()
    assert (aside / "loss.png").read_bytes() == (inline / "loss.png").read_bytes()
    assert drawer._proc.poll() == 0 and _no_tmp(aside)  # the child ended with the logger


def test_a_drawing_process_that_died_leaves_the_drawing_to_the_logger(tmp_path, caplog):
    logger = MetricsLogger(tmp_path, plot_keys=("loss",), pngs={"loss": LOSS}, png_share=None, rank_of_several=True)
    logger._drawer._proc.kill()
    logger._drawer._proc.wait()
    _log_steps(logger, (10, 20, 30))
    logger.close()
    assert (tmp_path / "loss.png").read_bytes() == render_png({"loss": [(10, 0.4), (20, 0.2), (30, round(4.0 / 30, 6))]}, LOSS)
    assert sum("drawing process ended" in r.getMessage() for r in caplog.records) == 1
