"""The opt-in phase timer of the training loops: off, it neither reads clocks nor synchronises;
on, phases are exclusive, per-step values are means, and start-up is reported once."""
import time

import pytest

from dare_core import timing
from dare_core.timing import PhaseTimer, phase, phase_times_requested


@pytest.fixture
def syncs(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "_sync", lambda: calls.append(1))
    return calls


def test_off_is_free(syncs):
    timer = PhaseTimer(False)
    with timer.active():
        timer.step_begin()
        with timer.phase("forward_backward"), phase("reward"):
            pass
        metrics = {}
        with timer.export(metrics):
            pass
    assert timer.step_metrics() == {} and metrics == {}
    assert syncs == []  # normal training keeps its asynchronous kernel launches


def test_nested_phases_are_exclusive(syncs):
    timer = PhaseTimer(True)
    with timer.active():
        timer.step_begin()
        with timer.phase("rollout"):
            time.sleep(0.05)
            with phase("reward"):  # library code charges the running loop's timer
                time.sleep(0.10)
    m = timer.step_metrics()
    assert 0.04 < m["time/rollout_s"] < 0.09  # without the nested reward
    assert 0.09 < m["time/reward_s"] < 0.14
    assert m["time/step_s"] >= m["time/rollout_s"] + m["time/reward_s"]
    assert syncs  # on: every boundary waits for the GPU


def test_startup_once_and_per_step_means(syncs):
    timer = PhaseTimer(True)
    with timer.phase("load"):
        time.sleep(0.05)
    for _ in range(2):
        timer.step_begin()
        with timer.phase("optimizer"):
            time.sleep(0.02)
    first = timer.step_metrics()
    assert first["time/startup_s"] >= first["time/startup_load_s"] > 0.04
    assert "time/load_s" not in first  # start-up phases are not step phases
    assert 0.015 < first["time/optimizer_s"] < 0.035  # a mean over the two steps, not their sum
    timer.step_begin()
    second = timer.step_metrics()
    assert "time/startup_s" not in second and "time/optimizer_s" not in second


def test_phase_without_a_running_timer_does_nothing(syncs):
    with phase("reward"):
        pass
    assert syncs == []


def test_switch(monkeypatch):
    monkeypatch.delenv(timing.ENV_VAR, raising=False)
    assert not phase_times_requested(None)
    monkeypatch.setenv(timing.ENV_VAR, "1")
    assert phase_times_requested(None) and not phase_times_requested(False)
    monkeypatch.setenv(timing.ENV_VAR, "0")
    assert not phase_times_requested(None) and phase_times_requested(True)
