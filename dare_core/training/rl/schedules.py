"""RL schedules: the order a run calls the verbs of training/rl/verbs.py in. A schedule walks the
steps it is given and hands each finished one to `end_step` (metrics, validation, logging and the
checkpoint, the same for every schedule); a new schedule is one more function here, registered
under its rl.schedule name (config.RL_SCHEDULES)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from dare_core.registry import Registry
from dare_core.training import engine as eng
from dare_core.training.rl.verbs import (RLRun, Rollout, Update, collect, first_iteration_is_current, optimize, ratio_is_trivial,
                                         score, sync)

# end_step(step, the rollout trained on, its update, the step's start time, a rollout collected
# ahead for a later step: what the checkpoint after this step must keep)
StepEnd = Callable[[int, Rollout, Update, float, Optional[Rollout]], None]

SCHEDULES = Registry("RL schedule")


@SCHEDULES.register("on_policy")
def on_policy(run: RLRun, steps: Iterable[int], end_step: StepEnd, ahead: Optional[Rollout] = None) -> None:
    """Each step rolls out with its current weights, scores and updates on them."""
    trivial = ratio_is_trivial(run.cfg.rl)
    for step in steps:
        run.timer.step_begin()
        t0 = time.time()
        # rollouts and the no-grad scoring on the whole weights (under ZeRO-3: one gather a step)
        with eng.rollout_weights(run.engine, run.cfg.launch):
            rollout = collect(run, step)
            scores = score(run, rollout, old=not trivial, first_old=not first_iteration_is_current(run.cfg.rl))
        update = optimize(run, rollout, scores)
        sync(run, step)
        end_step(step, rollout, update, t0, None)


def behaviour_rollout(run: RLRun, step: int) -> Rollout:
    """Step `step`'s rollouts, with the old scores of the weights that drew them (the behaviour
    policy), since the update that uses them runs under newer weights."""
    rollout = collect(run, step)
    rollout.behaviour = score(run, rollout, ref=False).old
    return rollout


@SCHEDULES.register("one_step_off_policy")
def one_step_off_policy(run: RLRun, steps: Iterable[int], end_step: StepEnd, ahead: Optional[Rollout] = None) -> None:
    """Step t+1's rollouts are collected before step t's update, with the weights before it (the
    two could overlap); step t trains on the rollouts collected a step earlier. The first step of
    a fresh run trains on rollouts of its own weights; a resumed run continues from `ahead`, the
    rollout its checkpoint kept."""
    num_steps = run.cfg.rl.num_steps
    for step in steps:
        run.timer.step_begin()
        t0 = time.time()
        with eng.rollout_weights(run.engine, run.cfg.launch):
            current = ahead if ahead is not None else behaviour_rollout(run, step)
            ahead = behaviour_rollout(run, step + 1) if step + 1 < num_steps else None
            # the reference's scores at the update (the reference a step's KL is to, as on-policy)
            scores = score(run, current, old=False)
        scores.old = current.behaviour
        update = optimize(run, current, scores)
        sync(run, step)
        end_step(step, current, update, t0, ahead)


# the rollout a checkpoint keeps for the step after it, one file per rank, beside DeepSpeed's files
def ahead_file(rank: int) -> str:
    return f"rollout_ahead_rank{rank:03d}.pt"


def load_ahead(folder: Optional[Path], rank: int, device: torch.device) -> Optional[Rollout]:
    """The rollout a resumed checkpoint kept for its next step (None: it kept none)."""
    if folder is None or not (folder / ahead_file(rank)).is_file():
        return None
    return torch.load(folder / ahead_file(rank), map_location=device, weights_only=False)
