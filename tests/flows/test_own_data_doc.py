"""docs/own-data.md, run as written on a fresh project with a tiny model, so the page cannot drift
from the code: a new task with string answers (sorting letters), its own train and test files, a
reward of its own given as module:function, `lengths: auto`.

How the page is executed, in its order:
- a ```python block whose first line is `# <name>.py` is written to that file (the data script,
  the reward module);
- the ```yaml block of section 3 ("params.yaml") is put into params.yaml key by key, as the page
  says (every other key keeps its value);
- every ```bash block runs as it stands, under `bash -e`, in the project folder.
The project's params.yaml starts as the repository's, shrunk to a tiny model and a few steps
(`pipeline_helpers.TINY`, its run name left as shipped); the page's keys go on top. Section 5 edits the
training file and the reward module and runs `dvc status`, which must name both; after the page the
test edits the training file again and checks that `dvc repro` reruns prepare, and the reward's
edit the stages that read it.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dare_core.recipes import merged
from pipeline_helpers import REPO, TINY, make_project, worker_env

DOC = REPO / "docs" / "own-data.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def doc_blocks() -> list[tuple[str, str, str]]:
    """(section heading, language, text) of each fenced block, in the page's order."""
    text = DOC.read_text()
    headings = [(m.start(), m.group(0)) for m in re.finditer(r"^## .*$", text, re.M)]
    out = []
    for m in BLOCK.finditer(text):
        section = next((h for start, h in reversed(headings) if start < m.start()), "")
        out.append((section, m.group(1), m.group(2)))
    return out


def starting_params() -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    tiny = {key: value for key, value in copy.deepcopy(TINY).items() if key != "run"}
    return merged(params, {**tiny, "run": {"seed": 0}})


def dvc_json(repo: Path, env: dict, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "dvc", *args, "--json"], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_page_has_what_the_test_runs():
    blocks = doc_blocks()
    files = [text.splitlines()[0] for _, lang, text in blocks if lang == "python"]
    assert "# make_data.py" in files and "# sort_rewards.py" in files
    assert [lang for section, lang, _ in blocks if section.startswith("## 3.")] == ["yaml"]
    assert any("dvc repro" in text for _, lang, text in blocks if lang == "bash")


@pytest.mark.slow
def test_own_data_md_runs_as_written(tmp_path):
    env = worker_env()
    env.update(DVC_NO_ANALYTICS="1", GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    params = starting_params()
    repo = make_project(tmp_path / "project", params, env=env)
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    subprocess.run(["git", "commit", "-qm", "a fresh project"], cwd=repo, env=env, check=True)

    shell_output = []
    for section, lang, text in doc_blocks():
        first = text.splitlines()[0]
        if lang == "python" and re.fullmatch(r"# \S+\.py", first):
            (repo / first[2:]).write_text(text)
        elif lang == "yaml" and section.startswith("## 3."):
            params = merged(yaml.safe_load((repo / "params.yaml").read_text()), yaml.safe_load(text))
            (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        elif lang == "bash":
            if "dvc status" in text:  # section 5 edits the files: before it, the whole run is up to date
                assert dvc_json(repo, env, "status") == {"inputs": ["always changed"]}
            done = subprocess.run(["bash", "-e", "-c", text], cwd=repo, env=env, capture_output=True, text=True)
            assert done.returncode == 0, f"{text}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            shell_output.append(done.stdout + done.stderr)

    # no noise: an off stage's outputs are not empty, so DVC has nothing to warn about
    assert not [line for out in shell_output for line in out.splitlines() if line.endswith("' is empty.")]
    # the final table, scored on exactly the test file's rows, under the task's name
    test_rows = [json.loads(line) for line in (repo / "user" / "sort_letters_test.jsonl").read_text().splitlines()]
    table = (repo / "runs" / "embedded" / "eval" / "summary.md").read_text()
    assert "sort_letters" in table and all(f"| {c} |" in table for c in ("base", "sft", "rl")), table
    predictions = json.loads((repo / "runs" / "embedded" / "eval" / "opencompass" / "run" / "predictions" / "rl" /
                              "sort_letters.json").read_text())
    assert [p["gold"] for p in predictions.values()] == [r["ground_truth"] for r in test_rows]
    summary = json.loads((repo / "data" / "prepared" / "summary.json").read_text())
    assert summary["counts"]["eval"] == len(test_rows) and summary["rewards"] == ["sort_rewards:score"]
    # "a b c d e f": 11 tokens + EOS, derived because of `lengths: auto`
    assert summary["lengths"]["sft.pad_to"] == summary["lengths"]["eval.sampler.gen_length"] == 12
    # letters give no preference pairs: the stage is off, said in the summary and its metrics
    assert summary["counts"]["preference"] == 0 and any("preference stage will be off" in w for w in summary["warnings"])
    assert json.loads((repo / "metrics" / "preference.json").read_text())["enabled"] is False
    # the metrics diff after the temperature change: eval.json's numbers against the baseline commit
    assert "metrics/eval.json" in shell_output[-2] and "sort_letters" in shell_output[-2], shell_output[-2]
    # section 5: `dvc status` names the edited training file and reward module before anything runs
    assert "input_file@user/sort_letters.jsonl" in shell_output[-1] and "input_file@sort_rewards.py" in shell_output[-1]
    assert {"input_file@user/sort_letters.jsonl", "input_file@sort_rewards.py"} <= set(dvc_json(repo, env, "status"))

    # the source edited in place (same path, so no setting changed): prepare reruns and everything
    # that reads its outputs is out of date; the reward module is tracked the same way
    train = repo / "user" / "sort_letters.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    rows[0] = {"prompt": "sort j i h", "response": "h i j", "ground_truth": "h i j"}
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = (repo / "data" / "prepared" / "sft.parquet").read_bytes()
    run = subprocess.run([sys.executable, "-m", "dvc", "repro", "prepare"], cwd=repo, env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "Running stage 'prepare'" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert (repo / "data" / "prepared" / "sft.parquet").read_bytes() != before
    assert {"sft", "rl", "eval"} <= set(dvc_json(repo, env, "status"))
    reward = repo / "sort_rewards.py"
    reward.write_text(reward.read_text() + "\n# a comment is an edit too\n")
    subprocess.run([sys.executable, "-m", "dvc", "repro", "inputs"], cwd=repo, env=env, check=True, capture_output=True)
    assert "prepare" in dvc_json(repo, env, "status")
