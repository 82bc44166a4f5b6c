"""What a lost attempt of a flow run leaves behind, and how the run page tells it.

When a worker's host dies, nothing reports the end of its flow run or of the task running in it:
the server's zombie automation (automations.yaml) marks the flow run Crashed, but its task runs
would stay Running (or Pending) for good, their timeline bars growing. Two pieces close them:

- `close_crashed_run`, a flow of its own deployed beside the pipeline (prefect.yaml's
  `dare-close-crashed-run`, started by its trigger when a dare-pipeline run turns Crashed), marks
  the lost task runs Crashed right away, so their duration ends with the run's, and puts the crash
  on the run page: a `dare-crash` markdown artifact with the reason, what was running and its last
  lines.
- A retry of the flow run (the UI's Retry) is a new attempt of the same flow run, with a higher run
  count. Its first step (`take_over`) closes what is still open (no worker was there to run the
  closing flow) and counts each stage's tries in the lost attempts, so that the stage table says
  `attempts 2` for a stage tried before; keyed artifacts the lost attempt already published are not
  published again (`EarlierAttempts.published`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from uuid import UUID

from prefect import flow, get_client, get_run_logger
from prefect.client.schemas.actions import ArtifactCreate
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterTaskRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)
from prefect.client.schemas.objects import StateType, TaskRun
from prefect.client.schemas.sorting import LogSort
from prefect.states import Crashed

# what a live attempt leaves a task run in until it ends it
OPEN = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
LAST_LINES = 12  # of each lost stage's log, on the crash artifact


@dataclass
class EarlierAttempts:
    closed: list[str] = field(default_factory=list)  # task runs this attempt found open and closed
    tries: Counter = field(default_factory=Counter)  # stage -> its tries in earlier attempts that did not complete
    published: set[str] = field(default_factory=set)  # artifact keys earlier attempts published


def lost_task_runs(task_runs: list[TaskRun], attempt: int) -> list[TaskRun]:
    """The open task runs of attempts before `attempt` (a task run records the flow run's run count
    of the attempt that ran it)."""
    return [t for t in task_runs if t.state_type in OPEN and t.flow_run_run_count < attempt]


def _close(client, runs: list[TaskRun], message: str) -> list[str]:
    for run in runs:
        # forced: the attempt that owned the task run is gone, and no state it could still propose
        # matters; the caller passes only task runs that have not ended
        client.set_task_run_state(run.id, Crashed(message=message), force=True)
    return [run.name for run in runs]


def _task_runs(client, flow_run_id: UUID | str) -> list[TaskRun]:
    return client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])))


def take_over(flow_run_id: UUID | str, flow_run_name: str, attempt: int) -> EarlierAttempts:
    """At the start of attempt `attempt`: mark Crashed the task runs earlier attempts left open,
    count each stage's unfinished tries in them and note the artifact keys they published. Attempt 1
    asks the API nothing."""
    earlier = EarlierAttempts()
    if attempt <= 1:
        return earlier
    with get_client(sync_client=True) as client:
        task_runs = _task_runs(client, flow_run_id)
        for run in task_runs:
            if run.flow_run_run_count < attempt and run.state_type != StateType.COMPLETED:
                earlier.tries[run.name] += max(run.run_count, 1)
        for run in lost_task_runs(task_runs, attempt):
            message = (f"attempt {run.flow_run_run_count} of flow run {flow_run_name!r} stopped before this "
                       f"task ended (its worker or host died); closed by attempt {attempt}")
            earlier.closed += _close(client, [run], message)
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        earlier.published = {a.key for a in artifacts if a.key}
    return earlier


def crash_markdown(run_name: str, reason: str, when: str, lost: list[tuple[TaskRun, list[str]]]) -> str:
    """The `dare-crash` artifact: why the run crashed, which stages it lost, and their last lines."""
    out = [f"## Flow run {run_name!r} crashed", "", f"**Reason:** {reason or 'not given'}", "",
           f"**Marked Crashed:** {when}", ""]
    if not lost:
        out.append("No stage was running: the run was lost between stages.")
    for run, lines in lost:
        started = run.start_time.isoformat(timespec="seconds") if run.start_time else "not started"
        out += [f"### Stage `{run.name}` (started {started}, attempt {run.flow_run_run_count})", ""]
        out += ["```", *lines[-LAST_LINES:], "```", ""] if lines else ["(no log lines reached the server)", ""]
    out += ["", "Retry the flow run (its menu, Retry): each stage continues from its last checkpoint in the "
                "run's workspace, and the stage table shows the step it resumed from."]
    return "\n".join(out)


@flow(name="dare-close-crashed-run", flow_run_name="close {flow_run_id}")
def close_crashed_run(flow_run_id: str) -> list[str]:
    """Started by prefect.yaml's trigger when a dare-pipeline flow run turns Crashed: mark its open
    task runs Crashed (their bars end now, not at a retry) and publish the `dare-crash` artifact on
    the crashed run. Returns the names of the task runs it closed. A run that is no longer Crashed
    (retried meanwhile) is left alone."""
    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        crashed = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        if not crashed or crashed[0].state_type != StateType.CRASHED:
            logger.info("flow run %s is not Crashed (now %s): nothing to close", flow_run_id,
                        crashed[0].state_type.value if crashed else "missing")
            return []
        run = crashed[0]
        reason = run.state.message or ""
        lost = [t for t in _task_runs(client, flow_run_id) if t.state_type in OPEN]
        logs = {t.id: [log.message for log in client.read_logs(
            log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[t.id])), sort=LogSort.TIMESTAMP_DESC,
            limit=LAST_LINES)][::-1] for t in lost}
        closed = _close(client, lost, f"flow run {run.name!r} crashed: {reason}")
        when = run.state.timestamp.isoformat(timespec="seconds") if run.state.timestamp else "unknown"
        client.create_artifact(ArtifactCreate(
            key="dare-crash", type="markdown", flow_run_id=run.id,
            data=crash_markdown(run.name, reason, when, [(t, logs[t.id]) for t in lost]),
            description=f"why flow run {run.name!r} crashed, and the stages it lost"))
    logger.info("flow run %s crashed (%s): closed %s", run.name, reason, ", ".join(closed) or "no task run")
    return closed
