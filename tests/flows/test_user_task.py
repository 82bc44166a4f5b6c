"""A user's own task through `dvc repro` with config changes only: a "sort these digits" training
file with string answers, a separate test file, a reward of the user's own given as module:function,
and every length left to `auto`. The eval stage must score exactly the test file's rows, under the
task's name."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from pipeline_helpers import REPO, sort_rows, tiny_params, worker_env, write_params

REWARD_MODULE = '''
def score(completion, ground_truth, row):
    """1 when the digits come back sorted, spaces ignored; the row says which task it is."""
    assert row["task"] == "sort_digits"
    return {"score": float(completion.replace(" ", "") == ground_truth.replace(" ", "")), "pred": completion}


def _check(ground_truth):
    if sorted(ground_truth.split()) != ground_truth.split():
        raise ValueError(f"{ground_truth!r} is not sorted")


score.validate = _check
'''


@pytest.mark.slow
def test_a_user_task_runs_through_dvc_repro_and_eval_scores_its_test_file(tmp_path):
    repo = tmp_path / "repo"
    (repo / "user").mkdir(parents=True)
    shutil.copy(REPO / "dvc.yaml", repo / "dvc.yaml")
    os.symlink(REPO / "dare_core", repo / "dare_core")
    os.symlink(REPO / "configs", repo / "configs")  # the recipes dvc.yaml depends on
    (repo / "sort_rewards.py").write_text(REWARD_MODULE)
    rows = sort_rows(400, seed=0)
    train, test = rows[:340], rows[340:]
    test[-1] = dict(train[0])  # one test prompt the training file also has: the manifest must say so
    for name, part in (("sort_digits.jsonl", train), ("sort_digits_test.jsonl", test)):
        (repo / "user" / name).write_text("".join(json.dumps(r) + "\n" for r in part))

    params = tiny_params(tmp_path)
    params["run"].update(runs_dir="runs", models_dir="models", metrics_dir="metrics")
    params["data"].update(prepared_dir="data/prepared", tokenizer_dir="data/tokenizer", source="user/sort_digits.jsonl",
                          eval_source="user/sort_digits_test.jsonl", task_args={}, num_sft=200, num_rl=64, num_val=16,
                          num_preference=32)
    params["model"]["init"]["max_sequence_length"] = "auto"
    params["rl"].update(reward="sort_rewards:score")
    for section in ("sft", "preference"):
        params[section]["pad_to"] = "auto"
    for section in ("rl", "eval"):
        params[section]["sampler"].update(gen_length="auto", steps="auto", block_length="auto")
    write_params(repo / "params.yaml", params)
    env = worker_env()
    env.update(DVC_NO_ANALYTICS="1")
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)

    run = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    summary = json.loads((repo / "data" / "prepared" / "summary.json").read_text())
    assert summary["counts"]["eval"] == len(test) and summary["overlaps"]["eval_train"] == 1
    assert summary["overlaps"]["sft_rl"] == 0 and summary["rewards"] == ["sort_rewards:score"]
    # "sort a b c d" answers "a b c d": 7 tokens + EOS, in every auto canvas
    assert summary["lengths"]["sft.pad_to"] == summary["lengths"]["eval.sampler.gen_length"] == 8
    metrics = json.loads((repo / "metrics" / "eval.json").read_text())
    for checkpoint in ("base", "sft", "rl"):
        assert list(metrics[checkpoint]) == ["sort_digits"]
    predictions = json.loads((repo / "runs" / "t" / "eval" / "opencompass" / "run" / "predictions" / "rl" /
                              "sort_digits.json").read_text())
    assert [p["gold"] for p in predictions.values()] == [r["ground_truth"] for r in test]
    assert all(f"sort {r['prompt'][5:]}" in p["origin_prompt"] for p, r in zip(predictions.values(), test))

    # the source edited in place (same path, so no setting changed): prepare reruns and everything
    # that reads its outputs is out of date; the user's reward module is tracked the same way
    def dvc_json(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "dvc", *args, "--json"], cwd=repo, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert dvc_json("status") == {"inputs": ["always changed"]}
    edited = [dict(r) for r in train]
    edited[0] = {**edited[0], "prompt": "sort 9 9 9 0", "response": "0 9 9 9", "ground_truth": "0 9 9 9"}
    (repo / "user" / "sort_digits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edited))
    before = (repo / "data" / "prepared" / "sft.parquet").read_bytes()
    run = subprocess.run([sys.executable, "-m", "dvc", "repro", "prepare"], cwd=repo, env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "Running stage 'prepare'" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert (repo / "data" / "prepared" / "sft.parquet").read_bytes() != before
    stale = dvc_json("status")
    assert {"sft", "preference", "rl", "eval"} <= set(stale), stale

    (repo / "sort_rewards.py").write_text(REWARD_MODULE + "\n# a comment is an edit too\n")
    subprocess.run([sys.executable, "-m", "dvc", "repro", "inputs"], cwd=repo, env=env, check=True, capture_output=True)
    assert "prepare" in dvc_json("status")
