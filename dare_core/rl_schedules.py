"""The RL schedules as records (`RL_SCHEDULES`, by rl.schedule name): what each one means for the
rest of the run, read by the config check, the checkpoint fingerprint, the resume and the
scoring shortcuts. The order a schedule calls the step's verbs in is a function attached to its
record by name in training/rl/schedules.py.

This module sits in the config layer: `RLConfig` checks rl.schedule against these names when the
config loads, before (and without) any training code is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

from dare_core.registry import Registry


@dataclass(frozen=True)
class ScheduleRecord:
    """What a schedule declares.

    keeps_ahead: rollouts collected ahead of the step being trained, which a checkpoint must keep
      (one file per rank each) for a resumed run to continue identically.
    skips_old_scores: its update starts at the weights that drew the rollouts, so the on-policy
      shortcuts (verbs.ratio_is_trivial, verbs.first_iteration_is_current) may skip old scores.
    in_fingerprint: rl.schedule is part of the checkpoint fingerprint (a checkpoint of another
      schedule is refused).
    records_behaviour: its rollouts carry the old scores of the weights that drew them
      (`Rollout.behaviour`), the behaviour policy the update's ratios are to."""

    name: str
    keeps_ahead: int
    skips_old_scores: bool
    in_fingerprint: bool
    records_behaviour: bool

    def __post_init__(self) -> None:
        # a rollout collected ahead is trained on after the weights that drew it have stepped: its
        # old scores can only be the behaviour policy's, taken when it was drawn
        if self.keeps_ahead > 0 and (self.skips_old_scores or not self.records_behaviour):
            raise ValueError(f"RL schedule '{self.name}' keeps {self.keeps_ahead} rollouts ahead: it must record their "
                             f"behaviour scores and cannot skip old scores")
        if self.keeps_ahead < 0:
            raise ValueError(f"RL schedule '{self.name}': keeps_ahead must be >= 0, got {self.keeps_ahead}")


RL_SCHEDULES = Registry("RL schedule")


def declare(record: ScheduleRecord) -> ScheduleRecord:
    """Register `record` under its name."""
    return RL_SCHEDULES.register(record.name)(record)


# not in the fingerprint: checkpoints made before rl.schedule existed (all on-policy) still resume
declare(ScheduleRecord("on_policy", keeps_ahead=0, skips_old_scores=True, in_fingerprint=False, records_behaviour=False))
declare(ScheduleRecord("one_step_off_policy", keeps_ahead=1, skips_old_scores=False, in_fingerprint=True,
                       records_behaviour=True))
