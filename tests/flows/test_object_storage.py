"""The whole pipeline against object storage (moto's S3 server on 127.0.0.1): the training and test
files are read from s3:// (`data.source`, `data.eval_source`), every stage copies its outputs to
`run.artifact_root: s3://...`, and the project's DVC remote is an S3 bucket on the same endpoint
(`dvc remote add -d storage s3://... && dvc remote modify storage endpointurl ...`, credentials
from the AWS_* environment, never in .dvc/config). After `dvc push`, a fresh `git clone` + `dvc
pull` has everything: `dvc status` is clean and `dvc repro` re-runs nothing. No credential is ever
printed.

The project is a copy of the repository's code (not symlinks into the checkout), as a clone of a
real project is: the clone gets dare_core from git, without the interpreter's `__pycache__` folders
that running the stages leaves in the original; and bytecode is written as it is by default
(PYTHONDONTWRITEBYTECODE unset), so the stages leave those folders where a user's run would."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_helpers import REPO, sort_rows, tiny_params, worker_env, write_params
from s3_server import ACCESS_KEY, SECRET, s3_bucket, s3_server  # noqa: F401  (fixtures)

STAGES = ("prepare", "sft", "preference", "rl", "convert", "eval")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(cmd: list[str], cwd: Path, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check:
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def dvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def git(*args: str) -> list[str]:
    return ["git", "-c", "user.name=dare-test", "-c", "user.email=dare@test", *args]


@pytest.mark.slow
def test_pipeline_on_s3_pushes_and_a_fresh_clone_pulls_with_nothing_to_reproduce(tmp_path, s3_server, s3_bucket):
    import fsspec

    # ---- a project: the repository's code, pipeline, ignore files; tiny params reading from s3://
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(REPO / name, repo / name)
    for name in ("dare_core", "configs"):  # dvc.yaml's code dependencies and the recipes
        shutil.copytree(REPO / name, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    fs = fsspec.filesystem("s3", skip_instance_cache=True)  # the fixture's AWS_* environment
    rows = sort_rows(400, seed=0)
    train, test = rows[:340], rows[340:]
    data_url = f"s3://{s3_bucket}/data"
    for name, part in (("sort_digits.jsonl", train), ("sort_digits_test.jsonl", test)):
        fs.pipe(f"{data_url}/{name}", "".join(json.dumps(r) + "\n" for r in part).encode())
    artifacts = f"s3://{s3_bucket}/artifacts"

    params = tiny_params(tmp_path)
    params["run"].update(runs_dir="runs", models_dir="models", metrics_dir="metrics", artifact_root=artifacts)
    params["data"].update(prepared_dir="data/prepared", tokenizer_dir="data/tokenizer",
                          source=f"{data_url}/sort_digits.jsonl", eval_source=f"{data_url}/sort_digits_test.jsonl",
                          task_args={}, num_sft=200, num_rl=64, num_val=16, num_preference=32)
    params["model"]["init"]["max_sequence_length"] = "auto"
    params["rl"].update(reward="exact_match", reward_args={"whitespace": "collapse"})
    for section in ("sft", "preference"):
        params[section]["pad_to"] = "auto"
    for section in ("rl", "eval"):
        params[section]["sampler"].update(gen_length="auto", steps="auto", block_length="auto")
    write_params(repo / "params.yaml", params)

    env = worker_env()  # with the fixture's AWS_* variables: fake credentials, the moto endpoint
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
               DVC_NO_ANALYTICS="1")
    env.pop("PREFECT_API_URL", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's environment: the stages leave __pycache__ behind
    run(["git", "init", "-q"], repo, env)
    run(dvc("init", "-q"), repo, env)

    # ---- the whole pipeline, through the Prefect flow
    t0 = time.perf_counter()
    flow = run([sys.executable, "-m", "flows.pipeline", "--repo", str(repo)], REPO, env, check=False)
    flow_s = time.perf_counter() - t0
    told = flow.stdout + flow.stderr
    assert flow.returncode == 0, flow.stdout[-4000:] + flow.stderr[-4000:]
    assert SECRET not in told
    print(f"pipeline: {flow_s:.0f} s")

    metrics = json.loads((repo / "metrics" / "eval.json").read_text())
    for checkpoint in ("base", "sft", "rl"):
        assert list(metrics[checkpoint]) == ["sort_digits"]  # scored on the s3:// test file, under its name
    summary = json.loads((repo / "data" / "prepared" / "summary.json").read_text())
    assert summary["counts"]["eval"] == len(test)

    # the artifact root holds the run's outputs, each a copy of the local file
    base = f"{s3_bucket}/artifacts/t"
    remote = {p[len(base) + 1:] for p in fs.find(base)}
    rl_tags = sorted(p.name for p in (repo / "runs/t/rl/checkpoints").glob("step*"))
    assert rl_tags
    for rel in ("runs/t/sft/model/config.json", "models/t/config.json", "metrics/eval.json", "metrics/sft.json",
                "metrics/rl.json", "metrics/preference.json", "runs/t/rl/checkpoints/latest",
                f"runs/t/rl/checkpoints/{rl_tags[-1]}/dare_checkpoint.json", "runs/t/preference/model/config.json"):
        assert rel in remote, f"{rel} not in {artifacts}/t: {sorted(remote)}"
        assert fs.cat(f"{base}/{rel}") == (repo / rel).read_bytes(), rel
    assert f"-> {artifacts}/t/models/t (" in flow.stdout  # the upload lines, URL shown without credentials

    # ---- commit the project, add the documented DVC remote, push
    assert (repo / "dvc.lock").is_file()
    run(git("add", "-A"), repo, env)
    run(git("commit", "-qm", "pipeline run"), repo, env)
    dvc_remote = f"s3://{s3_bucket}/dvc"
    run(dvc("remote", "add", "-d", "storage", dvc_remote), repo, env)
    run(dvc("remote", "modify", "storage", "endpointurl", str(s3_server)), repo, env)
    config = (repo / ".dvc" / "config").read_text()
    assert dvc_remote in config and str(s3_server) in config
    assert SECRET not in config and ACCESS_KEY not in config  # credentials come from the environment
    assert not (repo / ".dvc" / "config.local").exists()
    run(git("add", ".dvc/config"), repo, env)
    run(git("commit", "-qm", "DVC remote on S3"), repo, env)
    t0 = time.perf_counter()
    push = run(dvc("push"), repo, env)
    push_s = time.perf_counter() - t0
    assert SECRET not in push.stdout + push.stderr
    assert fs.find(f"{s3_bucket}/dvc"), "dvc push wrote nothing to the remote"
    # nothing the pipeline needs is left out of the cache / remote
    cloud = run(dvc("status", "--cloud", "--json"), repo, env)
    lines = cloud.stdout.strip().splitlines()
    assert (json.loads(lines[-1]) if lines else {}) == {}, cloud.stdout

    # ---- a fresh clone: dvc pull, then nothing to reproduce
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path, env)
    # metrics/*.json are git's (small, `cache: false`: committed); everything else comes from the remote
    assert not (clone / "runs").exists() and (clone / "metrics" / "eval.json").exists()
    t0 = time.perf_counter()
    pull = run(dvc("pull"), clone, env)
    pull_s = time.perf_counter() - t0
    assert SECRET not in pull.stdout + pull.stderr
    # only `inputs`, which DVC runs every time to hash the input files (dare_core/inputs.py)
    status = run(dvc("status", "--json"), clone, env)
    assert json.loads(status.stdout.strip().splitlines()[-1]) == {"inputs": ["always changed"]}, status.stdout + status.stderr

    # the pulled outputs are the original files
    assert (clone / "metrics" / "eval.json").read_bytes() == (repo / "metrics" / "eval.json").read_bytes()
    weights = sorted(p.relative_to(repo) for p in (repo / "models" / "t").glob("*.safetensors"))
    ckpt = sorted(p.relative_to(repo) for p in (repo / "runs/t/rl/checkpoints" / rl_tags[-1]).rglob("*") if p.is_file())
    assert weights and ckpt
    for rel in weights + ckpt + [Path("runs/t/sft/loss.csv"), Path("runs/t/rl/reward.csv"),
                                 Path("data/prepared/sft.parquet")]:
        assert sha256(clone / rel) == sha256(repo / rel), rel

    # dvc repro in the clone runs no stage but `inputs`, whose record of the input files is unchanged
    t0 = time.perf_counter()
    repro = run(dvc("repro"), clone, env)
    repro_s = time.perf_counter() - t0
    out = repro.stdout + repro.stderr
    assert re.findall(r"Running stage '(\w+)'", out) == ["inputs"], out
    assert (clone / "metrics" / "inputs.json").read_bytes() == (repo / "metrics" / "inputs.json").read_bytes()
    for stage in STAGES:
        assert f"Stage '{stage}' didn't change, skipping" in out, out
    assert json.loads(run(dvc("status", "--json"), clone, env).stdout.strip().splitlines()[-1]) == {"inputs": ["always changed"]}
    assert SECRET not in out
    print(f"push {push_s:.0f} s, pull {pull_s:.0f} s, repro (nothing to do) {repro_s:.0f} s")
