"""The whole pipeline against object storage (moto's S3 server on 127.0.0.1): the training and test
files are read from s3:// (`data.source`, `data.eval_source`, set with the flow's overrides, as a
deployment would), every stage copies its outputs to `run.artifact_root: s3://...`, and the DVC
remote block of docs/operating.md ("Object storage") runs as written: commit, `dvc push`, then a
fresh `git clone` + `dvc pull` has everything: `dvc status` shows only `inputs` and `dvc repro`
reruns nothing else. In that clone, with prepare's outputs deleted and a new artifact root, the
flow's stage task restores prepare from DVC's cache (without running it) and copies its outputs to
the new root, and fills in the copies of a stage that is up to date (eval). No credential is ever
printed.

The project is a copy of the repository's code (not symlinks into the checkout), committed and
pushed to a bare repository as a user's project would be: the clone gets dare_core from git,
without the interpreter's `__pycache__` folders that running the stages leaves in the original;
and bytecode is written as it is by default (PYTHONDONTWRITEBYTECODE unset), so the stages leave
those folders where a user's run would."""
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

from pipeline_helpers import REPO, copy_pipeline, sort_rows, tiny_params, worker_env, write_params
from s3_server import ACCESS_KEY, SECRET, s3_bucket, s3_server  # noqa: F401  (fixtures)

STAGES = ("prepare", "sft", "preference", "rl", "convert", "eval")
DOC = REPO / "docs" / "operating.md"
# what the test puts in place of the page's placeholders; each must appear in the block exactly once
PLACEHOLDERS = ("s3://bucket/", "http://127.0.0.1:9000", "<repo-url>")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(cmd: list[str], cwd: Path, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check:
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def dvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def dvc_status(repo: Path, env: dict) -> dict:
    return json.loads(run(dvc("status", "--json"), repo, env).stdout.strip().splitlines()[-1])


def flow(repo: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    """The pipeline through the Prefect flow, as `python -m flows.pipeline --repo ... --set ...`."""
    sets = [arg for o in overrides for arg in ("--set", o)]
    done = run([sys.executable, "-m", "flows.pipeline", "--repo", str(repo), *sets], REPO, env, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert SECRET not in done.stdout + done.stderr
    return done


def remote_block(bucket: str, endpoint: str, origin: Path) -> tuple[str, str]:
    """The DVC-remote block of docs/operating.md's "Object storage" section, placeholders replaced:
    (the commands for the project, the commands run "# elsewhere", in an empty folder)."""
    text = DOC.read_text()
    section = text[text.index("## Object storage"):]
    section = section[:section.index("\n## ", 1)]
    blocks = [b for b in re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M) if "dvc remote add" in b]
    assert len(blocks) == 1, blocks
    block = blocks[0]
    for placeholder, value in zip(PLACEHOLDERS, (f"s3://{bucket}/", endpoint, str(origin))):
        assert block.count(placeholder) == 1, f"{placeholder!r} is not once in the block:\n{block}"
        block = block.replace(placeholder, value)
    here, sep, elsewhere = block.partition("# elsewhere\n")
    assert sep and "git clone" in elsewhere and "dvc push" in here, block
    return here, elsewhere


@pytest.mark.slow
def test_pipeline_on_s3_pushes_and_a_fresh_clone_pulls_with_nothing_to_reproduce(tmp_path, s3_server, s3_bucket,
                                                                                    capfd):
    import fsspec

    # ---- a project: the repository's code, pipeline, ignore files; tiny params, committed and pushed
    repo, origin = tmp_path / "repo", tmp_path / "origin.git"
    repo.mkdir()
    copy_pipeline(repo)
    for name in (".gitignore", ".dvcignore"):
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

    # the inputs and the artifact root stay at params.yaml's defaults (null): the run sets them
    params = tiny_params(tmp_path)
    assert params["data"]["source"] is None and params["run"]["artifact_root"] is None
    params["run"].update(runs_dir="runs", models_dir="models", metrics_dir="metrics")
    params["data"].update(prepared_dir="data/prepared", tokenizer_dir="data/tokenizer",
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
               DVC_NO_ANALYTICS="1", GIT_AUTHOR_NAME="dare-test", GIT_AUTHOR_EMAIL="dare@test",
               GIT_COMMITTER_NAME="dare-test", GIT_COMMITTER_EMAIL="dare@test")
    env.pop("PREFECT_API_URL", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's environment: the stages leave __pycache__ behind
    run(["git", "init", "-q", "--bare", str(origin)], tmp_path, env)
    run(["git", "init", "-q"], repo, env)
    run(dvc("init", "-q"), repo, env)
    run(["git", "remote", "add", "origin", str(origin)], repo, env)
    run(["git", "add", "-A"], repo, env)
    run(["git", "commit", "-qm", "project"], repo, env)
    run(["git", "push", "-q", "-u", "origin", "HEAD"], repo, env)

    # ---- the whole pipeline, through the Prefect flow, its inputs and artifact root set by overrides
    t0 = time.perf_counter()
    flow(repo, env, f"data.source={data_url}/sort_digits.jsonl", f"data.eval_source={data_url}/sort_digits_test.jsonl",
         f"run.artifact_root={artifacts}")
    flow_s = time.perf_counter() - t0

    metrics = json.loads((repo / "metrics" / "eval.json").read_text())
    for checkpoint in ("base", "sft", "rl"):
        assert list(metrics[checkpoint]) == ["sort_digits"]  # scored on the s3:// test file, under its name
    summary = json.loads((repo / "data" / "prepared" / "summary.json").read_text())
    assert summary["counts"]["eval"] == len(test)
    inputs = json.loads((repo / "metrics" / "inputs.json").read_text())
    assert inputs["data.source"]["url"] == f"{data_url}/sort_digits.jsonl"  # the stages read the overridden keys

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

    # ---- docs/operating.md's DVC-remote block, as written: remote, commit, push; a fresh clone pulls
    here, elsewhere = remote_block(s3_bucket, str(s3_server), origin)
    t0 = time.perf_counter()
    told = run(["bash", "-e", "-c", here], repo, env)
    push_s = time.perf_counter() - t0
    config = (repo / ".dvc" / "config").read_text()
    assert f"s3://{s3_bucket}/" in config and str(s3_server) in config
    assert SECRET not in config and ACCESS_KEY not in config  # credentials come from the environment
    assert not (repo / ".dvc" / "config.local").exists()
    assert SECRET not in told.stdout + told.stderr
    assert fs.find(f"{s3_bucket}/dare-dvc"), "dvc push wrote nothing to the remote"
    # nothing the pipeline needs is left out of the cache / remote, or out of git
    cloud = run(dvc("status", "--cloud", "--json"), repo, env)
    lines = cloud.stdout.strip().splitlines()
    assert (json.loads(lines[-1]) if lines else {}) == {}, cloud.stdout
    assert run(["git", "status", "--porcelain"], repo, env).stdout == ""

    (tmp_path / "elsewhere").mkdir()
    t0 = time.perf_counter()
    told = run(["bash", "-e", "-c", elsewhere], tmp_path / "elsewhere", env)
    pull_s = time.perf_counter() - t0
    assert SECRET not in told.stdout + told.stderr
    clone = tmp_path / "elsewhere" / "dare-run"
    assert re.findall(r"^(\S+):$", told.stdout, re.M) == ["inputs"], told.stdout  # what `dvc status` listed
    # only `inputs`, which DVC runs every time to hash the input files (dare_core/inputs.py)
    assert dvc_status(clone, env) == {"inputs": ["always changed"]}

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
    assert SECRET not in out

    # ---- the flow's stage task in the clone, to a new artifact root set by an override, with
    # prepare's outputs gone: DVC restores prepare from its cache without running it, eval is up to
    # date, and the outputs of both reach the new root (run_stage is what the Prefect task runs)
    from tasks.dvc_stage import run_stage
    from tasks.workspace import apply_overrides

    again = f"s3://{s3_bucket}/again"
    apply_overrides(clone / "params.yaml", [f"run.artifact_root={again}"])
    for rel in ("data/prepared", "data/tokenizer"):
        shutil.rmtree(clone / rel)
    t0 = time.perf_counter()
    results = [run_stage(stage, clone, publish=True) for stage in ("prepare", "eval")]
    again_s = time.perf_counter() - t0
    assert [(r.stage, r.status) for r in results] == [("prepare", "restored"), ("eval", "skipped")]
    assert dvc_status(clone, env) == {"inputs": ["always changed"]}
    told = capfd.readouterr()  # what the stage task echoed: DVC's and the uploads' lines
    assert "uploaded data/prepared -> " in told.out and SECRET not in told.out + told.err
    base = f"{s3_bucket}/again/t"
    copies = {p[len(base) + 1:] for p in fs.find(base)}
    # every output file of the two stages but the stage folder's own dot-files (publish_stage skips those)
    local = {p.relative_to(clone).as_posix() for top in ("data/prepared", "data/tokenizer", "runs/t/eval", "metrics/eval.json")
             for p in [clone / top, *(clone / top).rglob("*")]
             if p.is_file() and not (p.parent == clone / "runs/t/eval" and p.name.startswith("."))}
    assert local and copies == local, f"{again}: {sorted(copies ^ local)}"
    for rel in ("data/prepared/sft.parquet", "metrics/eval.json", "runs/t/eval/summary.md"):
        assert fs.cat(f"{base}/{rel}") == (clone / rel).read_bytes(), rel
    with capfd.disabled():
        print(f"pipeline {flow_s:.0f} s; remote block: push {push_s:.0f} s, clone and pull {pull_s:.0f} s; repro "
              f"(nothing to do) {repro_s:.0f} s; a restored and an up-to-date stage uploaded {again_s:.0f} s")
