"""Opt-in phase times of the training loops: where a step's seconds go.

Off by default, and then free: a phase timer that is off neither reads the clock nor synchronises
the GPU, so normal training keeps its asynchronous kernel launches. On (`DARE_PHASE_TIMES=1`, or
`phase_times=True` to `run_sft` / `run_rl` / `run_preference`), every phase boundary waits for the
GPU (`torch.cuda.synchronize()`), so each phase is charged with its own kernels, and the loops log,
with each step's metrics in metrics.jsonl:

    time/rollout_s time/reward_s time/scoring_s time/forward_backward_s time/optimizer_s
    time/step_s      the whole step (phases, data handling and the rest)
    time/startup_s   stage start to the first step (first logged row only), with its phases as
                     time/startup_<phase>_s (checks, load, engine)
    time/export_s    the final model export (a row of its own, after the last step)
    memory/peak_gib  peak GPU memory allocated during the logged steps (CUDA only)

Per-step values are means over the steps since the last logged row. Phases nest and are exclusive:
time spent in an inner phase (the reward, inside the rollout) is not counted again in the outer one.
Library code marks its phases with the module-level `phase(name)`, which charges the timer of the
running loop (`PhaseTimer.active()`), or does nothing.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator, Optional

import torch

ENV_VAR = "DARE_PHASE_TIMES"

_ACTIVE: Optional["PhaseTimer"] = None


def phase_times_requested(flag: Optional[bool]) -> bool:
    """`flag` when given, else the environment variable (anything but empty or 0 switches it on)."""
    if flag is not None:
        return flag
    return os.environ.get(ENV_VAR, "").strip() not in ("", "0")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseTimer:
    """Seconds per phase of the current step(s), and the stage's start-up and export times.

    Created when the stage starts (start-up is measured from there)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._sums: dict[str, float] = {}
        self._stack: list[list] = []  # [name, start, seconds spent in nested phases]
        self._steps = 0
        self._step_start: Optional[float] = None
        self._step_total = 0.0
        self._startup: Optional[float] = None
        self._startup_parts: dict[str, float] = {}
        self._startup_logged = False

    @contextlib.contextmanager
    def active(self) -> Iterator["PhaseTimer"]:
        """Make this the timer that `phase(name)` charges while the loop runs."""
        global _ACTIVE
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        _sync()
        entry = [name, time.perf_counter(), 0.0]
        self._stack.append(entry)
        try:
            yield
        finally:
            _sync()
            self._stack.pop()
            spent = time.perf_counter() - entry[1]
            self._sums[name] = self._sums.get(name, 0.0) + spent - entry[2]
            if self._stack:  # the enclosing phase does not count this time again
                self._stack[-1][2] += spent

    def step_begin(self) -> None:
        """At the top of every step: the first one ends the start-up."""
        if not self.enabled:
            return
        _sync()
        now = time.perf_counter()
        if self._startup is None:  # what was timed so far belongs to the start-up
            self._startup = now - self._t0
            self._startup_parts, self._sums = self._sums, {}
        self._close_step(now)
        self._step_start = now
        self._steps += 1
        if torch.cuda.is_available() and torch.cuda.is_initialized() and self._steps == 1:
            torch.cuda.reset_peak_memory_stats()

    def _close_step(self, now: float) -> None:
        if self._step_start is not None:
            self._step_total += now - self._step_start
            self._step_start = None

    def step_metrics(self) -> dict[str, float]:
        """Mean seconds per step of each phase since the last call (then reset); {} when off."""
        if not self.enabled or not self._steps:
            return {}
        _sync()
        self._close_step(time.perf_counter())
        n = self._steps
        out = {f"time/{name}_s": seconds / n for name, seconds in self._sums.items()}
        out["time/step_s"] = self._step_total / n
        if not self._startup_logged:
            out["time/startup_s"] = self._startup
            out.update({f"time/startup_{name}_s": seconds for name, seconds in self._startup_parts.items()})
            self._startup_logged = True
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        self._sums, self._steps, self._step_total = {}, 0, 0.0
        return out

    @contextlib.contextmanager
    def export(self, metrics: dict) -> Iterator[None]:
        """Time the final export into `metrics["time/export_s"]` (left untouched when off)."""
        if not self.enabled:
            yield
            return
        _sync()
        t = time.perf_counter()
        yield
        metrics["time/export_s"] = time.perf_counter() - t


def phase(name: str):
    """A phase of the running loop's timer; nothing when no timer is on."""
    if _ACTIVE is None or not _ACTIVE.enabled:
        return contextlib.nullcontext()
    return _ACTIVE.phase(name)
