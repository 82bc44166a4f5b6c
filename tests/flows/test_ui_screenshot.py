"""Acceptance test of the Prefect UI: a real Prefect server on 127.0.0.1, the pipeline flow run
against it (`python -m flows.pipeline`, a subprocess) on a throwaway DVC repo, then headless Chromium
(Playwright) opens the flow-run page and checks that the stage log lines and every artifact the run
published are shown. Screenshots go to tmp_path; with DARE_UPDATE_DOCS=1 they are also copied to
docs/images/ (prefect_flow_run.png, prefect_artifacts.png) for the README.

The repo's stages are cheap (`python stage.py <name>`, a second or so each) but print like a real
stage: "step 10 loss 2.31" lines on stdout, a tqdm-style `\\r` progress bar on stderr, a metrics
file. The whole test takes about 30-60 s.

Needs Chromium at /usr/bin/chromium (Debian's `chromium`, `make browser`; another binary with
DARE_CHROMIUM) and the `playwright` package (requirements/test.txt; its own browser download is
not used). Skipped, with the reason, when either is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ports import unused_port
from prefect_server import PrefectServer, api_post
from ui_browser import DOCS_IMAGES, UI_TIMEOUT_MS, browser_missing, browser_page, find_text, settle

REPO = Path(__file__).resolve().parents[2]

STAGES = ["prepare", "sft", "preference", "rl", "convert", "eval"]
# Text that the flow run's Logs view must show (substrings of log lines). Extend freely, e.g. with
# the stages' own output lines ("prepare: step 30 loss").
EXPECTED_LOG_LINES = [f"stage {stage}: attempt 1 in" for stage in STAGES] + [
    "prepare: step 30 loss", "sft: 100%|##########| 30/30", "stage sft: ran in", "eval: done"]
# Artifact keys the flow publishes on a full run (the test also checks that every key the API lists
# for the flow run is shown on the page).
EXPECTED_ARTIFACTS = {"dare-run", "dare-stages", "dare-eval-table", "dare-eval-metrics", "dare-sft-report", "dare-rl-report"}

STAGE_PY = """\
import json, os, sys, time

stage = sys.argv[1]
for step in (10, 20, 30):
    print(f"{stage}: step {step} loss {2.31 - step / 100:.2f}", flush=True)
for done in range(0, 31, 10):  # tqdm-style: redraws one line with carriage returns
    bar = "#" * (done // 3)
    sys.stderr.write(f"\\r{stage}: {100 * done // 30:3d}%|{bar:<10}| {done}/30 [00:00<00:00]")
    sys.stderr.flush()
    time.sleep(0.05)
sys.stderr.write("\\n")
os.makedirs("out", exist_ok=True)
os.makedirs("metrics", exist_ok=True)
with open(f"out/{stage}.txt", "w") as f:
    f.write(stage + "\\n")
if stage in ("sft", "preference", "rl"):
    with open(f"metrics/{stage}.json", "w") as f:
        json.dump({"final_loss": 2.01, "steps": 30}, f)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(f"runs/embedded/{stage}", exist_ok=True)
    fig, ax = plt.subplots(figsize=(4, 2.5), dpi=80)
    ax.plot([10, 20, 30], [2.21, 2.11, 2.01], marker="o")
    ax.set_title(f"{stage} loss"), ax.set_xlabel("step"), ax.set_ylabel("loss")
    fig.tight_layout()
    fig.savefig(f"runs/embedded/{stage}/loss.png")
if stage == "eval":
    with open("metrics/eval.json", "w") as f:
        json.dump({"base": {"arithmetic": 2.5}, "sft": {"arithmetic": 61.0}, "rl": {"arithmetic": 74.0},
                   "artifacts": {"base": "runs/embedded/base", "sft": "runs/embedded/sft/model",
                                 "rl": "models/embedded"}}, f)
print(f"{stage}: done", flush=True)
"""

# stage -> (its upstream stage, whether it writes metrics/<stage>.json): the pipeline's shape
STAGE_GRAPH = {"prepare": (None, False), "sft": ("prepare", True), "preference": ("sft", True),
               "rl": ("sft", True), "convert": ("rl", False), "eval": ("convert", True)}
DVC_YAML = "stages:\n" + "".join(
    f"  {stage}:\n    cmd: python stage.py {stage}\n"
    f"    deps: [{f'out/{up}.txt' if up else 'stage.py'}]\n    outs: [out/{stage}.txt]\n"
    + (f"    metrics: [{{metrics/{stage}.json: {{cache: false}}}}]\n" if metrics else "")
    for stage, (up, metrics) in STAGE_GRAPH.items())


pytestmark = pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))


def _make_repo(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "stage.py").write_text(STAGE_PY)
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "params.yaml").write_text("run:\n  name: embedded\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)


@pytest.fixture
def server(tmp_path):
    srv = PrefectServer(tmp_path / "prefect_home", unused_port())
    try:
        yield srv.start()
    finally:
        srv.stop()


def _server_log(srv: PrefectServer) -> str:
    path = srv.home / "server.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.mark.timeout(600)
def test_flow_run_page_shows_stage_logs_and_artifacts(tmp_path, server):
    # The UI asks the server where its API is (ui-settings, from PREFECT_UI_API_URL).
    assert server.env()["PREFECT_UI_API_URL"] == server.api
    with urllib.request.urlopen(f"{server.url}/ui-settings", timeout=10) as r:
        assert json.loads(r.read())["api_url"] == server.api

    repo = tmp_path / "repo"
    _make_repo(repo)
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", "--repo", str(repo), "--stages", ",".join(STAGES)],
        cwd=REPO, env=server.env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=420,
    )
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{_server_log(server)}"
    print(f"flow run: {time.monotonic() - t0:.1f} s")

    flow_runs = api_post(server, "flow_runs/filter",
                         {"flows": {"name": {"any_": ["dare-pipeline"]}}, "sort": "EXPECTED_START_TIME_DESC"})
    assert len(flow_runs) == 1, [fr["name"] for fr in flow_runs]
    flow_run = flow_runs[0]
    assert flow_run["state_type"] == "COMPLETED", flow_run["state"]
    artifacts = api_post(server, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    keys = sorted({a["key"] for a in artifacts if a.get("key")})
    assert EXPECTED_ARTIFACTS <= set(keys), keys

    url = f"{server.url}/runs/flow-run/{flow_run['id']}"
    shots = {"flow_run": tmp_path / "prefect_flow_run.png", "artifacts": tmp_path / "prefect_artifacts.png",
             "report": tmp_path / "prefect_stage_report.png"}
    report_id = next(a["id"] for a in artifacts if a.get("key") == "dare-sft-report")
    outside: list[str] = []  # requests that leave the local server (a CDN would break offline use)
    page_errors: list[str] = []  # uncaught JavaScript exceptions, shown when a check fails
    t0 = time.monotonic()
    with browser_page(tmp_path / "chromium-profile") as page:
        page.on("request", lambda req: req.url.startswith(("http:", "https:"))
                and not req.url.startswith(server.url) and outside.append(req.url))
        page.on("pageerror", lambda exc: page_errors.append(str(exc)))
        page.goto(url, wait_until="domcontentloaded", timeout=UI_TIMEOUT_MS)

        # The run: its name, its state, its flow, and the Logs view (the default tab).
        page.get_by_text(flow_run["name"], exact=True).first.wait_for(timeout=UI_TIMEOUT_MS)
        page.get_by_text("Completed", exact=True).first.wait_for(timeout=UI_TIMEOUT_MS)
        page.get_by_text("dare-pipeline", exact=True).first.wait_for(timeout=UI_TIMEOUT_MS)
        assert find_text(page, EXPECTED_LOG_LINES[0], UI_TIMEOUT_MS / 1000), \
            f"{EXPECTED_LOG_LINES[0]!r} not in the Logs view ({page_errors=}):\n{page.inner_text('body')[-3000:]}"
        settle(page)
        page.screenshot(path=str(shots["flow_run"]), full_page=True)

        # Every expected log line, scrolling the logs as needed.
        missing = [text for text in EXPECTED_LOG_LINES if not find_text(page, text, 30, scroll=".log-row")]
        assert not missing, f"not in the Logs view: {missing} ({page_errors=})\n{page.inner_text('body')[-3000:]}"

        # The Artifacts tab lists every artifact the API has for this run.
        tab = page.locator(".p-tab").filter(has_text=re.compile(r"^\s*Artifacts\s*$"))
        (tab.first if tab.count() else page.get_by_text("Artifacts", exact=True).first).click()
        if not find_text(page, keys[0], 20):  # the tab's own URL, in case the click missed
            page.goto(f"{url}?tab=Artifacts", wait_until="domcontentloaded")
        not_shown = [key for key in keys if not find_text(page, key, UI_TIMEOUT_MS / 1000)]
        assert not not_shown, f"artifacts not shown: {not_shown} (API: {keys}, {page_errors=})\n{page.inner_text('body')[-3000:]}"
        page.mouse.move(0, 0)  # no hover highlight on a card
        page.evaluate("document.querySelectorAll('*').forEach(e => { if (e.scrollTop) e.scrollTop = 0; })")
        settle(page)
        page.screenshot(path=str(shots["artifacts"]), full_page=True)

        # A stage's report: its metrics table and its plot, drawn as an image on the page.
        page.goto(f"{server.url}/artifacts/artifact/{report_id}", wait_until="domcontentloaded")
        page.get_by_text("final_loss").first.wait_for(timeout=UI_TIMEOUT_MS)
        image = page.locator("img[src^='data:image/png']").first
        image.wait_for(timeout=UI_TIMEOUT_MS)
        assert image.evaluate("img => img.complete && img.naturalWidth > 0"), "the plot did not render"
        settle(page)
        page.screenshot(path=str(shots["report"]), full_page=True)
    print(f"browser: {time.monotonic() - t0:.1f} s")

    if page_errors:  # not a failure by itself: Prefect 3.8's UI throws "Cannot read properties of null
        # (reading 'getBoundingClientRect')" on every run here, without any visible effect on the page
        print(f"JavaScript errors on the page: {page_errors}")
    assert not outside, f"the UI fetched from outside the Prefect server: {sorted(set(outside))}"
    # ... nor did the server for it, nor the flow (tests/prefect_server.py: every proxy variable points there)
    assert not server.outbound.seen, f"tried to connect beyond the machine: {server.outbound.seen}"
    for path in shots.values():
        assert path.stat().st_size > 20_000, f"{path} is suspiciously small (a blank page?)"
    if os.environ.get("DARE_UPDATE_DOCS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        for path in shots.values():
            shutil.copyfile(path, DOCS_IMAGES / path.name)
