"""automations.yaml fits prefect.yaml and the flow: what `prefect automation create --from-file` accepts,
windows that leave room for a late heartbeat, and the flow name the automations watch. The automations at
work against a real server: tests/flows/test_deployments.py."""
from __future__ import annotations

from pathlib import Path

import yaml
from prefect.events.schemas.automations import AutomationCore

from flows.attempts import close_crashed_run
from flows.pipeline import dare_pipeline

REPO = Path(__file__).resolve().parents[1]
AUTOMATIONS = yaml.safe_load((REPO / "automations.yaml").read_text())["automations"]
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


def test_each_automation_is_one_prefect_accepts():
    assert [AutomationCore.model_validate(a).name for a in AUTOMATIONS] == [
        "dare-crash-unresponsive-runs", "dare-finish-lost-cancellations"]


def test_every_deployment_beats_often_enough_for_the_crash_window():
    window = next(a for a in AUTOMATIONS if a["name"] == "dare-crash-unresponsive-runs")["trigger"]["within"]
    for deployment in [d for d in DEPLOYMENTS if d["entrypoint"] == "flows/pipeline.py:dare_pipeline"]:
        beat = int(deployment["work_pool"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"])
        # Prefect refuses less than 30 s; one late beat must not crash a live run
        assert 30 <= beat and 2 * beat < window, (deployment["name"], beat, window)


def test_the_automations_watch_the_pipeline_flow():
    for automation in AUTOMATIONS:
        assert automation["trigger"]["match_related"] == {
            "prefect.resource.role": "flow", "prefect.resource.name": dare_pipeline.name}


def test_a_crashed_pipeline_run_starts_the_flow_that_closes_it():
    """prefect.yaml's dare-close-crashed-run: a trigger Prefect accepts, on a Crashed run of the
    pipeline flow, handing the flow run's id to close_crashed_run (at work: test_deployments.py)."""
    from prefect.cli.deploy._triggers import _initialize_deployment_triggers

    spec = next(d for d in DEPLOYMENTS if d["name"] == "dare-close-crashed-run")
    module, name = spec["entrypoint"].split(":")
    assert (module, name) == ("flows/attempts.py", close_crashed_run.fn.__name__)
    (trigger,) = _initialize_deployment_triggers(spec["name"], spec["triggers"])
    assert trigger.match_related == AutomationCore.model_validate(AUTOMATIONS[0]).trigger.match_related
    assert list(trigger.expect) == ["prefect.flow-run.Crashed"] and trigger.parameters == {"flow_run_id": "{{ flow_run.id | string }}"}
    assert spec["work_pool"]["name"] == next(d for d in DEPLOYMENTS if d["name"] == "dare-pipeline")["work_pool"]["name"]
