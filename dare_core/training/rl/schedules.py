"""RL schedules: the order a run calls the verbs of training/rl/verbs.py in, one walking function
per record of dare_core/rl_schedules.py (what the schedule keeps ahead, records and skips),
attached to it by name with `@walks`. A schedule walks the steps it is given and hands each
finished one to `end_step` (metrics, validation, logging and the checkpoint, the same for every
schedule), with the rollouts it holds ahead, which the checkpoint keeps and a resumed run
continues from (`load_ahead`)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from dare_core.config import RLConfig
from dare_core.registry import Registry
from dare_core.rl_schedules import RL_SCHEDULES
from dare_core.training import engine as eng
from dare_core.training.rl.verbs import (RLRun, Rollout, Update, collect, first_iteration_is_current, optimize, ratio_is_trivial,
                                         score, sync)

# end_step(step, the rollout trained on, its update, the step's start time, the rollouts collected
# ahead for later steps, in step order: what the checkpoint after this step must keep)
StepEnd = Callable[[int, Rollout, Update, float, list[Rollout]], None]
# walk(run, the steps to run, end_step, the rollouts a resumed checkpoint kept ahead)
Walk = Callable[[RLRun, Iterable[int], StepEnd, list[Rollout]], None]

SCHEDULES = Registry("RL schedule walk")


def walks(name: str) -> Callable[[Walk], Walk]:
    """Attach the decorated function to the schedule record `name` (a function without a record
    fails at import)."""
    RL_SCHEDULES.lookup(name)
    return SCHEDULES.register(name)


@walks("on_policy")
def on_policy(run: RLRun, steps: Iterable[int], end_step: StepEnd, ahead: list[Rollout]) -> None:
    """Each step rolls out with its current weights, scores and updates on them."""
    trivial = ratio_is_trivial(run.rl)
    for step in steps:
        run.timer.step_begin()
        t0 = time.time()
        # rollouts and the no-grad scoring on the whole weights (under ZeRO-3: one gather a step)
        with eng.rollout_weights(run.engine, run.launch):
            rollout = collect(run, step)
            scores = score(run, rollout, old=not trivial, first_old=not first_iteration_is_current(run.rl))
        update = optimize(run, rollout, scores)
        sync(run, step)
        end_step(step, rollout, update, t0, [])


def behaviour_rollout(run: RLRun, step: int) -> Rollout:
    """Step `step`'s rollouts, with the old scores of the weights that drew them (the behaviour
    policy), since the update that uses them runs under newer weights."""
    rollout = collect(run, step)
    rollout.behaviour = score(run, rollout, ref=False).old
    return rollout


@walks("one_step_off_policy")
def off_policy(run: RLRun, steps: Iterable[int], end_step: StepEnd, ahead: list[Rollout]) -> None:
    """Before step t's update the rollouts of the steps up to t + keeps_ahead (the record's) are
    collected, with the weights before it (the two could overlap); step t trains on the rollouts
    collected keeps_ahead steps earlier. The first step of a fresh run trains on rollouts of its
    own weights and collects those ahead with them too; a resumed run continues from `ahead`,
    the rollouts its checkpoint kept."""
    depth, num_steps = RL_SCHEDULES.lookup(run.rl.schedule).keeps_ahead, run.rl.num_steps
    ahead = list(ahead)
    for step in steps:
        run.timer.step_begin()
        t0 = time.time()
        with eng.rollout_weights(run.engine, run.launch):
            current = ahead.pop(0) if ahead else behaviour_rollout(run, step)
            while len(ahead) < depth and step + 1 + len(ahead) < num_steps:
                ahead.append(behaviour_rollout(run, step + 1 + len(ahead)))
            # the reference's scores at the update (the reference a step's KL is to, as on-policy)
            scores = score(run, current, old=False)
        scores.old = current.behaviour
        update = optimize(run, current, scores)
        sync(run, step)
        end_step(step, current, update, t0, list(ahead))


def ahead_file(rank: int, index: int = 0) -> str:
    """The file of the `index`-th rollout a checkpoint keeps ahead (0: the next step's), one per
    rank beside DeepSpeed's files. The first keeps the name of one-ahead checkpoints made before
    schedules could keep more, so they still resume."""
    return f"rollout_ahead_rank{rank:03d}.pt" if index == 0 else f"rollout_ahead{index}_rank{rank:03d}.pt"


def ahead_files(rank: int, ahead: list[Rollout]) -> dict[str, Rollout]:
    """This rank's files of the rollouts held ahead, for the checkpoint (file name -> rollout)."""
    return {ahead_file(rank, index): rollout for index, rollout in enumerate(ahead)}


def load_ahead(folder: Optional[Path], rank: int, device: torch.device, rl: RLConfig, start: int) -> list[Rollout]:
    """The rollouts a checkpoint of step `start` kept for the steps after it: as many as the
    schedule keeps ahead, less those past the last step (none for a fresh run)."""
    record = RL_SCHEDULES.lookup(rl.schedule)
    count = min(record.keeps_ahead, rl.num_steps - start) if start > 0 else 0
    kept = []
    for index in range(count):
        name = ahead_file(rank, index)
        if folder is None or not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: no {name}: rl.schedule {rl.schedule} resumes from the {count} rollouts "
                                    f"the checkpoint kept for steps {start}-{start + count - 1}")
        rollout = torch.load(folder / name, map_location=device, weights_only=False)
        if rollout.step != start + index or (record.records_behaviour and rollout.behaviour is None):
            scores = " with its behaviour scores" if record.records_behaviour else ""
            raise ValueError(f"{folder / name}: not the rollout of step {start + index}{scores} (rl.schedule {rl.schedule})")
        kept.append(rollout)
    return kept
