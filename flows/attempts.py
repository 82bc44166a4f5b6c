"""Closing the task runs that a lost attempt of a flow run left open.

When a worker's host dies, nothing reports the end of its flow run or of the task running in it:
the server's zombie automation (automations.yaml) marks the flow run Crashed, but its task runs
stay Running (or Pending) for good. A retry of the flow run (the UI's Retry) is a new attempt of
the same flow run, with a higher run count; the task runs it creates are new ones, so the dead
attempt's are never touched again. At the start of each later attempt the flow closes them here,
so the run's timeline shows each stage once as running.
"""
from __future__ import annotations

from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import (
    TaskRunFilter,
    TaskRunFilterFlowRunId,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType, TaskRun
from prefect.states import Crashed

# what a live attempt leaves a task run in until it ends it
OPEN = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]


def lost_task_runs(task_runs: list[TaskRun], attempt: int) -> list[TaskRun]:
    """The open task runs of attempts before `attempt` (a task run records the flow run's run count
    of the attempt that ran it)."""
    return [t for t in task_runs if t.state_type in OPEN and t.flow_run_run_count < attempt]


def close_lost_task_runs(flow_run_id: UUID | str, flow_run_name: str, attempt: int) -> list[str]:
    """Mark Crashed the task runs of `flow_run_id` that earlier attempts left open; returns their
    names. Attempt 1 has no earlier attempt and asks the API nothing."""
    if attempt <= 1:
        return []
    closed = []
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]),
            state=TaskRunFilterState(type=TaskRunFilterStateType(any_=OPEN))))
        for run in lost_task_runs(task_runs, attempt):
            message = (f"attempt {run.flow_run_run_count} of flow run {flow_run_name!r} stopped before this "
                       f"task ended (its worker or host died); closed by attempt {attempt}")
            # forced: the attempt that owned the task run is gone, and no state it could still
            # propose matters; the filter above already left out every finished task run
            client.set_task_run_state(run.id, Crashed(message=message), force=True)
            closed.append(run.name)
    return closed
