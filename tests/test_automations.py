"""automations.yaml fits prefect.yaml and the flow: what `prefect automation create --from-file` accepts,
windows that leave room for a late heartbeat, and the flow name the automations watch. The automations at
work against a real server: tests/flows/test_deployments.py."""
from __future__ import annotations

from pathlib import Path

import yaml
from prefect.events.schemas.automations import AutomationCore

from flows.pipeline import dare_pipeline

REPO = Path(__file__).resolve().parents[1]
AUTOMATIONS = yaml.safe_load((REPO / "automations.yaml").read_text())["automations"]
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


def test_each_automation_is_one_prefect_accepts():
    assert [AutomationCore.model_validate(a).name for a in AUTOMATIONS] == [
        "dare-crash-unresponsive-runs", "dare-finish-lost-cancellations"]


def test_every_deployment_beats_often_enough_for_the_crash_window():
    window = next(a for a in AUTOMATIONS if a["name"] == "dare-crash-unresponsive-runs")["trigger"]["within"]
    for deployment in DEPLOYMENTS:
        beat = int(deployment["work_pool"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"])
        # Prefect refuses less than 30 s; one late beat must not crash a live run
        assert 30 <= beat and 2 * beat < window, (deployment["name"], beat, window)


def test_the_automations_watch_the_pipeline_flow():
    for automation in AUTOMATIONS:
        assert automation["trigger"]["match_related"] == {
            "prefect.resource.role": "flow", "prefect.resource.name": dare_pipeline.name}
