"""The real pipeline end to end on a tiny config: Prefect flow -> dvc repro of every stage ->
DeepSpeed workers -> eval table; a second run skips every stage."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline_helpers import REPO, make_project, tiny_params, worker_env, write_params


@pytest.mark.slow
def test_flow_runs_every_stage_then_skips(tmp_path):
    # every run shorter than its save_every (a smoke test; the shipped preference stage): no
    # checkpoint is due, yet each stage's declared checkpoints folder must exist for DVC
    params = tiny_params(tmp_path, sft__save_every=50, preference__save_every=25, rl__save_every=5)
    env = worker_env()
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180", DVC_NO_ANALYTICS="1")
    env.pop("PREFECT_API_URL", None)
    repo = make_project(tmp_path / "repo", params, env=env)

    run = subprocess.run([sys.executable, "-m", "flows.pipeline", "--repo", str(repo)], cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads((repo / "metrics" / "eval.json").read_text())
    assert list(metrics) == ["base", "sft", "rl", "artifacts"]  # the table shows them in pipeline order
    # the synthetic task, scored through OpenCompass (0-100). This config is sized for plumbing: 20 SFT
    # steps of a 32-wide model scored 0 at every stage (run seed 0; 300 steps at width 64: SFT 2.5,
    # RL 0), so learning is checked by test_embedded_learning.py on params.yaml as shipped
    for name in ("base", "sft", "rl"):
        assert list(metrics[name]) == ["arithmetic"] and 0.0 <= metrics[name]["arithmetic"] <= 100.0
    assert "| checkpoint | arithmetic | artifact path |" in run.stdout
    oc_run = repo / "runs" / "t" / "eval" / "opencompass" / "run"
    assert (oc_run / "summary.md").exists() and len(json.loads((oc_run / "predictions" / "rl" / "arithmetic.json").read_text())) == 40
    assert json.loads((repo / "runs" / "t" / "eval" / "manifest.json").read_text())["benchmarks"][0]["name"] == "task"
    # the converted RL folder is a loadable checkpoint with its tokenizer
    from dare_core.models.hf_folder import load_model
    from dare_core.models.tokenizer import load_tokenizer

    model = load_model(repo / "models" / "t")
    tok = load_tokenizer(repo / "models" / "t")
    assert model.mask_token_id == tok.mask_token_id
    assert (repo / "runs" / "t" / "sft" / "loss.csv").read_text().startswith("step,loss")
    assert (repo / "runs" / "t" / "rl" / "reward.csv").exists() and (repo / "runs" / "t" / "eval" / "accuracy.png").exists()
    assert (repo / "dvc.lock").exists()
    for stage in ("sft", "preference"):
        assert not any((repo / "runs" / "t" / stage / "checkpoints").glob("step*"))
    # the preference side branch exported its own loadable model and finite metrics
    pref = json.loads((repo / "metrics" / "preference.json").read_text())
    assert pref["algorithm"] == "vrpo" and pref["final_loss"] == pref["final_loss"]
    assert load_model(repo / "runs" / "t" / "preference" / "model").mask_token_id == tok.mask_token_id

    # nothing to rerun but `inputs`, which DVC runs every time to hash the input files
    again = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=repo, env=env, capture_output=True, text=True)
    assert json.loads(again.stdout.strip().splitlines()[-1]) == {"inputs": ["always changed"]}, again.stdout

    # DVC compares two evaluations: commit this one, re-evaluate on fewer problems, diff
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "run"], cwd=repo, check=True, env=env)
    params["eval"]["max_samples"] = 10
    write_params(repo / "params.yaml", params)
    rerun = subprocess.run([sys.executable, "-m", "dvc", "repro", "eval"], cwd=repo, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    diff = subprocess.run([sys.executable, "-m", "dvc", "metrics", "diff", "--all", "--json"], cwd=repo, env=env,
                          capture_output=True, text=True, check=True)
    changes = json.loads(diff.stdout)["metrics/eval.json"]
    assert {"base.arithmetic", "sft.arithmetic", "rl.arithmetic"} <= set(changes)
    assert changes["rl.arithmetic"]["old"] == metrics["rl"]["arithmetic"]
