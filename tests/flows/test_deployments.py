"""DARE deployed as an operator runs it: a real Prefect server on 127.0.0.1, prefect.yaml deployed with
`prefect deploy`, a process worker, and the real (tiny) pipeline.

- an interval schedule creates runs and the worker executes one to Completed;
- two deployment runs at once both complete, each in its own worktree (no `'data/tokenizer' is busy`),
  and the deploy checkout stays clean;
- a stage that fails in its worker fails its Prefect task with the worker's own error line;
- a run whose worker host dies is marked Crashed by automations.yaml; prefect.yaml's closing flow
  then ends its lost task (its duration its own) and puts the reason on the run page; a retry as
  the UI does resumes from its checkpoints, its stage table says from which step and counts the lost
  try, and no artifact is published twice.
"""
from __future__ import annotations

import contextlib
import json
from datetime import datetime
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import yaml

from pipeline_helpers import REPO, make_project, tiny_params, worker_env
from ports import unused_port
from prefect_server import PrefectServer, api_get, api_post, flow_runs, wait_for
from s3_server import REGION, s3_bucket, s3_server  # noqa: F401  (fixtures)
from ui_browser import browser_missing, browser_page, screenshot

pytestmark = pytest.mark.slow
POOL = "dare-test"
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
WORKER_ENV = {"TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}


def committed_project(root: Path) -> Path:
    """A committed DARE project: the real dvc.yaml, flows, tasks, code and recipes (symlinked), tiny params."""
    make_project(root, tiny_params(root), links=("dare_core", "configs", "flows", "tasks"))
    (root / ".gitignore").write_text(".cache/\n__pycache__/\n")
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run([*GIT, "commit", "-qm", "project"], cwd=root, check=True)
    return root


def deploy(server: PrefectServer, project: Path, name: str, parameters: dict, schedules: list, pool: str = POOL) -> str:
    """prefect.yaml's process deployment, pointed at the test pool, deployed with `prefect deploy`."""
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    spec = next(d for d in config["deployments"] if d["name"] == "dare-pipeline")
    spec.update(name=name, schedules=schedules)
    spec["parameters"].update(parameters)
    spec["work_pool"]["name"] = pool
    config["deployments"] = [spec]
    (project / "prefect.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    server.cli("--no-prompt", "deploy", "--name", name, cwd=project)
    return api_get(server, f"deployments/name/dare-pipeline/{name}")["id"]


def deploy_closer(server: PrefectServer, project: Path, pool: str) -> None:
    """prefect.yaml's dare-close-crashed-run (its trigger included), pointed at `pool`."""
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    spec = next(d for d in config["deployments"] if d["name"] == "dare-close-crashed-run")
    spec["work_pool"]["name"] = pool
    config["deployments"] = [spec]
    (project / "prefect.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    server.cli("--no-prompt", "deploy", "--name", spec["name"], cwd=project)


def run_deployment(server: PrefectServer, deployment_id: str, parameters: dict) -> str:
    return api_post(server, f"deployments/{deployment_id}/create_flow_run", {"parameters": parameters})["id"]


def final_state(server: PrefectServer, run_id: str, timeout: float) -> dict:
    def done():
        run = api_get(server, f"flow_runs/{run_id}")
        return run if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    try:
        return wait_for(done, timeout, f"flow run {run_id}", interval=2)
    except TimeoutError:
        raise AssertionError(f"flow run {run_id} did not finish; worker log:\n{server.worker_log()[-4000:]}")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    base = tmp_path_factory.mktemp("deployments")
    server = PrefectServer(base / "prefect", unused_port()).start()
    try:
        project = committed_project(base / "project")
        server.cli("work-pool", "create", POOL, "--type", "process")
        server.start_worker(POOL, cwd=project, limit=2, **WORKER_ENV)
        yield server, project
    finally:
        server.stop()


def test_an_interval_schedule_creates_runs_that_the_worker_executes(deployed):
    server, project = deployed
    dep = deploy(server, project, "scheduled", {"stages": ["prepare"]}, [{"interval": 20}])
    # the scheduler (its loop shortened to 2 s) creates runs ahead; the worker picks up the first due one
    runs = wait_for(lambda: flow_runs(server, dep, ["COMPLETED"]), 240, "a scheduled run to complete", interval=2)
    assert runs[0]["auto_scheduled"] is True and runs[0]["parameters"]["stages"] == ["prepare"]
    assert len(flow_runs(server, dep, ["SCHEDULED"])) >= 2  # more runs scheduled ahead
    server.cli("deployment", "delete", "dare-pipeline/scheduled")
    assert "bulk DML" not in (server.home / "server.log").read_text()


def test_concurrent_runs_complete_in_their_own_workspaces_and_failures_show_the_worker_error(deployed):
    server, project = deployed
    dep = deploy(server, project, "manual", {}, [])
    before = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True).stdout
    stages = ["prepare", "sft"]
    ids = [run_deployment(server, dep, {"stages": stages, "overrides": [f"sft.optim.lr={lr}"]}) for lr in (3e-3, 1e-3)]
    states = [final_state(server, i, 420) for i in ids]
    assert [s["state_type"] for s in states] == ["COMPLETED", "COMPLETED"], server.worker_log()[-4000:]
    workspaces = [project / ".cache" / "workspaces" / f"{s['name']}-{s['id'][:8]}" for s in states]
    for ws, lr in zip(workspaces, ("0.003", "0.001")):
        assert (ws / "runs" / "t" / "sft" / "model" / "config.json").exists()
        assert f"lr: {lr}" in (ws / "params.yaml").read_text()
        assert json.loads((ws / "metrics" / "sft.json").read_text())
    after = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True).stdout
    assert after == before and not (project / "runs").exists()  # the checkout was not touched
    assert "is busy" not in server.worker_log()

    # the run's artifacts: the SFT metrics of this run, and the overrides it was given
    arts = api_post(server, "artifacts/filter", {"flow_runs": {"id": {"any_": [ids[0]]}}})
    keys = {a["key"] for a in arts}
    assert {"dare-run", "dare-stages", "dare-sft-report"} <= keys
    run_info = next(a for a in arts if a["key"] == "dare-run")["data"]
    assert "`sft.optim.lr=0.003`" in run_info
    logs = api_post(server, "logs/filter", {"logs": {"flow_run_id": {"any_": [ids[0]]}}, "limit": 200})
    assert any("loss" in log["message"] and "step" in log["message"] for log in logs)  # the worker's step lines

    # a stage failing in its worker: the Prefect task's message is the worker's error line (a setting
    # that load_config refuses fails the flow before any stage: tests/dare_core/test_bad_input_paths.py)
    bad = run_deployment(server, dep, {"stages": ["prepare"], "overrides": ["model.init.n_heads=3"], "retries": 0})
    state = final_state(server, bad, 240)
    assert state["state_type"] == "FAILED"
    tasks = api_post(server, "task_runs/filter", {"flow_runs": {"id": {"any_": [bad]}}})
    # refused by the first stage that reads the settings (inputs), before prepare could delete anything
    (failed,) = [t for t in tasks if t["state_type"] == "FAILED"]
    assert failed["name"] == "inputs" and "prepare" not in [t["name"] for t in tasks], tasks
    assert "error: model.init: n_heads (3) must divide the width d_model" in failed["state"]["message"], failed
    # the reason is logged as an error (the UI's level filter), not only in the state message
    errors = api_post(server, "logs/filter", {"logs": {"task_run_id": {"any_": [failed["id"]]}, "level": {"ge_": 40}}})
    assert [log for log in errors if "error: model.init: n_heads (3)" in log["message"]], errors


# automations.yaml's windows are 90 s (for 30 s heartbeats, Prefect's shortest); the test's are shorter
ZOMBIE_WINDOW = 40
WINDOWS = {"dare-crash-unresponsive-runs": ZOMBIE_WINDOW, "dare-finish-lost-cancellations": 10}
LOST_POOL = "dare-test-lost"


def flow_run_env(worker: subprocess.Popen, run_id: str) -> dict:
    """The environment of the worker's process that runs flow run `run_id`."""
    for proc in psutil.Process(worker.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if (env := proc.environ()).get("PREFECT__FLOW_RUN_ID") == run_id:
                return env
    return {}


def warm_run_cache(project: Path, stage: str) -> None:
    """DVC's run cache holds `stage` at the project's params (what an earlier run leaves; here made
    sure of also when this test runs alone): a run in a fresh workspace then restores it."""
    from tasks.workspace import create_workspace

    work, _ = create_workspace(project, "warm-run-cache")
    subprocess.run(["dvc", "repro", stage], cwd=work, check=True, capture_output=True, env=worker_env())


def bucket_keys(endpoint: str, bucket: str) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page.get("Contents", [])]


def test_a_run_whose_worker_host_dies_is_crashed_and_a_retry_resumes_from_its_checkpoints(deployed, s3_server, s3_bucket,
                                                                                           tmp_path):
    server, project = deployed
    warm_run_cache(project, "prepare")
    automations = yaml.safe_load((REPO / "automations.yaml").read_text())
    for automation in automations["automations"]:
        automation["trigger"]["within"] = WINDOWS[automation["name"]]
    (server.home / "automations.yaml").write_text(yaml.safe_dump(automations))
    # a pool of its own (the shared pool's job template), so that the shared worker lives on for the other tests
    template = api_get(server, f"work_pools/{POOL}")["base_job_template"]
    api_post(server, "work_pools/", {"name": LOST_POOL, "type": "process", "base_job_template": template})
    worker = server.start_worker(LOST_POOL, cwd=project, **WORKER_ENV)
    with ThreadPoolExecutor(1) as background:  # the documented install step, while deploying
        installed = background.submit(server.cli, "automation", "create", "--from-file",
                                      str(server.home / "automations.yaml"))
        dep = deploy(server, project, "lost", {}, [], pool=LOST_POOL)
        deploy_closer(server, project, POOL)  # the shared pool's worker runs it
        installed.result()
    # a run cancelled after its worker died (here: one that never had a worker) stays Cancelling
    # unless the second automation finishes the cancellation; checked at the end
    cancelled = api_post(server, "flow_runs/", {"flow_id": api_get(server, f"deployments/{dep}")["flow_id"],
                                                "state": {"type": "RUNNING"}})["id"]
    api_post(server, f"flow_runs/{cancelled}/set_state", {"state": {"type": "CANCELLING"}})
    # copies to the local S3 server: prepare, restored from DVC's run cache, must reach the bucket too
    run_id = run_deployment(server, dep, {"stages": ["prepare", "sft"],
                                          "overrides": ["sft.max_steps=100", "sft.save_every=10", "sft.log_every=50",
                                                        f"run.artifact_root=s3://{s3_bucket}/runs"]})
    name = api_get(server, f"flow_runs/{run_id}")["name"]
    checkpoints = project / ".cache" / "workspaces" / f"{name}-{run_id[:8]}" / "runs" / "t" / "sft" / "checkpoints"
    wait_for(lambda: (checkpoints / "latest").exists(), 240, "an SFT checkpoint", interval=0.2)

    # prefect.yaml's heartbeat setting reached the flow run's processes (a run beats once at its start)
    assert flow_run_env(worker, run_id).get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY") == "30"
    server.kill_worker(worker)
    killed, killed_at = time.monotonic(), time.time()
    tag = (checkpoints / "latest").read_text().strip()  # the checkpoint a retry must resume from
    replacement = len(server.workers)
    server.start_worker(LOST_POOL, cwd=project, **WORKER_ENV)  # starts up while the server notices
    assert api_get(server, f"flow_runs/{run_id}")["state_type"] == "RUNNING"
    crashed = wait_for(lambda: (r := api_get(server, f"flow_runs/{run_id}"))["state_type"] == "CRASHED" and r,
                       ZOMBIE_WINDOW + 30, "the server to mark the lost run Crashed")
    # its last heartbeat came before the kill: Crashed within the window, the 5 s evaluation tick and polling
    assert time.monotonic() - killed < ZOMBIE_WINDOW + 10
    assert "dare-crash-unresponsive-runs" in crashed["state"]["message"]

    # the closing flow ends the lost SFT task with the run, before any retry: its bar stops growing
    def lost_sft():
        tasks = api_post(server, "task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
        sft = next((t for t in tasks if t["name"] == "sft"), None)
        return sft if sft and sft["state_type"] == "CRASHED" else None

    lost = wait_for(lost_sft, 120, "the lost SFT task to be closed", interval=1)
    assert lost["state"]["message"].startswith(f"flow run {name!r} crashed: no heartbeat"), lost["state"]
    ended = datetime.fromisoformat(lost["end_time"]).timestamp()
    assert ended - killed_at < ZOMBIE_WINDOW + 60, (ended - killed_at, lost)
    # ... and the run page says why: the reason and the stage's last lines
    crash = [a for a in api_post(server, "artifacts/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
             if a["key"] == "dare-crash"]
    assert len(crash) == 1 and "no heartbeat for" in crash[0]["data"] and "### Stage `sft`" in crash[0]["data"]
    # what the UI shows now (docs/operating.md's pictures: DARE_UPDATE_DOCS=1)
    if browser_missing() is None:
        with browser_page(tmp_path / "chromium") as page:
            screenshot(page, f"{server.url}/runs/flow-run/{run_id}", tmp_path / "prefect_crashed_run.png", [name, "Crashed"])
            screenshot(page, f"{server.url}/artifacts/artifact/{crash[0]['id']}", tmp_path / "prefect_crash_report.png",
                       ["Reason:", "Stage sft"])

    # the Retry of the flow run's menu in Prefect 3.8.8's default UI (ui-v2)
    retry = api_post(server, f"flow_runs/{run_id}/set_state", {
        "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True})
    assert retry["status"] == "ACCEPT", retry
    final = final_state(server, run_id, 300)
    assert final["state_type"] == "COMPLETED" and final["run_count"] == 2, server.worker_log(replacement)[-4000:]
    tasks = api_post(server, "task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    assert not [t["name"] for t in tasks if t["state_type"] in ("RUNNING", "PENDING", "SCHEDULED")]
    sft = {t["flow_run_run_count"]: t for t in tasks if t["name"] == "sft"}
    assert (sft[1]["state_type"], sft[2]["state_type"]) == ("CRASHED", "COMPLETED")
    assert sft[1]["end_time"] == lost["end_time"]  # the retry did not touch it again
    # the stage table: SFT resumed from the checkpoint, its second try (the lost one counted)
    arts = api_post(server, "artifacts/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    rows = {row["stage"]: row for row in json.loads(next(a for a in arts if a["key"] == "dare-stages")["data"])}
    assert rows["sft"]["status"] == f"ran, resumed from step {int(tag[4:])}" and rows["sft"]["attempts"] == 2, rows
    keys = [a["key"] for a in arts]
    assert len(keys) == len(set(keys)), keys  # the retry published nothing the lost attempt had
    if browser_missing() is None:
        with browser_page(tmp_path / "chromium") as page:
            screenshot(page, f"{server.url}/runs/flow-run/{run_id}", tmp_path / "prefect_retried_run.png", [name, "Completed"])
            stages = next(a for a in arts if a["key"] == "dare-stages")
            screenshot(page, f"{server.url}/artifacts/artifact/{stages['id']}", tmp_path / "prefect_retried_stages.png",
                       [f"ran, resumed from step {int(tag[4:])}"])
    logs = [log["message"] for log in api_post(server, "logs/filter",
                                               {"logs": {"task_run_id": {"any_": [sft[2]["id"]]}}})]
    assert [line for line in logs if "resuming SFT from" in line and tag in line], (tag, logs)
    assert api_get(server, f"flow_runs/{cancelled}")["state"]["message"].startswith("still Cancelling after 90 s")
    # the restored stage's outputs are in the bucket beside the trained one's
    prepare = next(t for t in tasks if t["name"] == "prepare" and t["flow_run_run_count"] == 1)
    prepare_logs = [log["message"] for log in api_post(server, "logs/filter", {"logs": {"task_run_id": {"any_": [prepare["id"]]}}})]
    assert [line for line in prepare_logs if "stage prepare: restored" in line], prepare_logs
    keys = bucket_keys(s3_server, s3_bucket)
    assert [k for k in keys if k.startswith("runs/t/data/prepared/")], keys[:20]
    assert [k for k in keys if k.startswith("runs/t/runs/t/sft/")], keys[:20]


def test_nothing_tried_to_reach_beyond_the_machine(deployed):
    """Last in the module: the server started as docs/operating.md says (`dare server`, dare.env),
    `prefect work-pool create` (which has the server fetch Prefect's collection registry), `prefect
    deploy`, the workers and the runs of the tests above, every proxy variable pointing at a listener
    (tests/prefect_server.py): nothing tried to connect beyond 127.0.0.1. A bare `prefect server
    start` sent its telemetry at once (`CONNECT sens-o-matic.prefect.io:443`, and `Failed to send
    telemetry` in its log) and fetched the registry from raw.githubusercontent.com."""
    server, _ = deployed
    settings = api_get(server, "admin/settings")["server"]
    assert (settings["analytics_enabled"], settings["ui"]["show_promotional_content"]) == (False, False)
    assert server.outbound.seen == []
    assert not [line for line in server.server_log().splitlines() if "telemetry" in line.lower()]
