"""bench/train_step.py --tiny runs the real stage loops (LoRA SFT packed and padded, one DARE RL step, and
d1's own step code where a d1 checkout is at bench/.peers/d1, else a row saying it is not) on CPU and
writes a results file whose every section holds numbers read from the loops' phase times. The compiled SFT variant is left out here: Inductor's CPU build took most of this
test's three minutes in CI, and compiled training is pinned to eager by tests/dare_core/models/test_compile.py."""
import json
import re
import subprocess
import sys

from pipeline_helpers import REPO, worker_env


def _table(text: str, heading: str) -> list[list[str]]:
    """The data rows of the markdown table under `heading`, as cells, less the first (the row's run)."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # the header row is not data
    return [[c.strip() for c in row.strip("|").split("|")][1:] for row in rows]


def _number(cell: str) -> float:
    return float(re.sub(r"[,x%]", "", cell))


def test_tiny_run_writes_every_section(tmp_path):
    out = tmp_path / "train_step.md"
    cmd = [sys.executable, str(REPO / "bench" / "train_step.py"), "--tiny", "--workdir", str(tmp_path / "work"),
           "--out", str(out), "--shapes", "llada", "--parts", "sft", "rl", "rl-d1", "--compile-shapes",
           "--side-by-side"]  # (on the CPU both children share its cores; on GPUs each has one of its own)
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()

    assert re.search(r"^Git commit: \S+", text, re.M)
    assert re.search(r"^Command: `python3 bench/train_step.py --tiny .*` \(\d{4}-\d\d-\d\d \d\d:\d\d UTC, commit [^)]+\)", text, re.M)
    assert re.search(r"^Hardware: .*\d+ CPU cores.*torch", text, re.M)

    sft = _table(text, "## SFT")
    assert [(row[1], row[2]) for row in sft] == [("LoRA", "on"), ("LoRA", "off")]
    for row in sft:
        sequences, real, padded, step_s, fwd_bwd, optimizer, tokens_per_s = map(_number, row[3:10])
        assert sequences == 8 and 0 < real <= padded  # padding is counted apart from the real tokens
        assert 0 < fwd_bwd + optimizer <= step_s + 0.0015  # each cell rounded to 1 ms: their sum may pass the step's by 1
        assert abs(tokens_per_s - real / step_s) <= 0.05 * tokens_per_s  # real tokens, not padding
    assert sft[0][3:5] == sft[1][3:5]  # every variant trains on the same batches
    assert _number(sft[0][12]) > 0  # the packed speed-up, computed against the padded row

    rl = _table(text, "## RL")
    assert rl[0][1] == "DARE" and rl[1][1].startswith("d1's own code")
    d1_here = (REPO / "bench" / ".peers" / "d1" / "diffu-grpo" / "diffu_grpo_trainer.py").exists()
    if not d1_here:  # (CI: no checkout of d1) the row says what is missing, and nothing is compared
        assert "d1's code is not on this machine" in rl[1][3] and "bench/.peers/d1" in rl[1][3]
        rl = rl[:1]
    for row in rl:
        phases = list(map(_number, row[3:8]))  # rollout, reward, scoring, fwd+bwd, optimizer
        other, step_s = _number(row[8]), _number(row[9])  # other: the step less its phases
        assert all(p >= 0 for p in phases) and phases[0] > 0 and phases[3] > 0
        assert other >= -0.02 and sum(phases) <= step_s + 0.02  # exclusive phases: nothing counted twice
        assert _number(row[12]) < 100  # the synthetic reward spreads every group (non-zero advantages)
    assert rl[0][10] == rl[0][11] == ""  # the training pass's MFU, the rollout's share of peak: no bf16 peak on the CPU
    if d1_here:
        assert re.fullmatch(r"d1's own code @[0-9a-f]{7}", rl[1][1])  # the peer's commit beside its row
        assert _number(rl[0][14]) > 0  # DARE's speed-up over d1's own code

    assert "ran at the same time, DARE's on GPU 0 and d1's on GPU 1" in text

    startup = _table(text, "## Start-up and export")
    assert len(startup) == 3  # the two SFT runs and DARE's RL run
    assert all(_number(row[2]) > 0 and _number(row[3]) > 0 for row in startup)  # process start, stage start-up
    assert _number(startup[0][7]) >= 0  # the packed LoRA run exported its merged model
    assert "## Targets" in text

    data = json.loads(out.with_suffix(".json").read_text())
    assert {r["part"] for r in data["rows"]} == {"folder", "sft", "rl", "rl-d1"}
    _check_training_pass_flops(tmp_path / "work" / "tiny" / "llada" / "model")
    assert [r["part"] for r in data["rows"] if "error" in r] == ([] if d1_here else ["rl-d1"])

    # --merge rewrites a results file from runs' JSON (runs split to fit a time limit), measuring nothing
    merged = tmp_path / "merged.md"
    cmd = [sys.executable, str(REPO / "bench" / "train_step.py"), "--merge", str(out.with_suffix(".json")), "--out", str(merged)]
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _table(merged.read_text(), "## SFT") == sft and "Written from those runs' JSON files" in merged.read_text()
    # --drop-parts leaves a superseded part's rows out of the merged file
    cmd += ["--drop-parts", "rl-d1"]
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [row[1] for row in _table(merged.read_text(), "## RL")] == ["DARE"]
    assert "--drop-parts rl-d1 --merge" in merged.read_text()


def _check_training_pass_flops(folder):
    """The RL row's training-pass FLOPs count the loop's passes: d1 on-policy with 2 inner iterations
    and a KL term scores the old policy once (the first iteration's old scores are the update's own)
    and the reference twice, and trains twice (forward + backward: 3 forwards' worth)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "bench"))
    from model_throughput import model_flops
    from train_step_runs import rl_pass_flops

    from dare_core.models.hf_folder import inspect_model

    rl = SimpleNamespace(schedule="on_policy", num_iterations=2, mini_batches=1, kl_beta=0.04, prompts_per_step=3, group_size=4)
    work = rl_pass_flops(SimpleNamespace(rl=rl), str(folder), {"step": 2, "sequence_tokens": 20.0})
    model = inspect_model(folder)
    forward = model_flops(model, [20.0] * 12, backward=False)
    assert forward > 0 and work == {"step": 2, "scoring_flops": 3 * forward, "update_flops": 6 * forward, "rollout_flops": None}
    # the rollout's: one token encoded against one key with its logits is one token's forward; each
    # kind of work counts apart (an encoded token without logits costs the body alone)
    one = {"step": 2, "sequence_tokens": 20.0, "rollout_encoded_tokens": 1, "rollout_key_pairs": 1, "rollout_logit_tokens": 1}
    assert rl_pass_flops(SimpleNamespace(rl=rl), str(folder), one)["rollout_flops"] == model_flops(model, [1.0], backward=False)
    c = model.config
    body = {**one, "rollout_encoded_tokens": 10, "rollout_key_pairs": 0, "rollout_logit_tokens": 0}
    assert rl_pass_flops(SimpleNamespace(rl=rl), str(folder), body)["rollout_flops"] == \
        10 * (model_flops(model, [1.0], backward=False) - 2 * c.d_model * c.vocab_size - 4 * c.n_layers * c.n_heads * c.head_dim)
    rl.kl_beta, rl.num_iterations = 0.0, 1  # on-policy, one iteration, no KL: no scoring pass at all
    assert rl_pass_flops(SimpleNamespace(rl=rl), str(folder), {"step": 2, "sequence_tokens": 20.0})["scoring_flops"] == 0


def test_replay_builds_the_rows_from_a_finished_runs_task_results(tmp_path):
    """--replay runs nothing: the rl-engines rows of the H200 run, read back from its tasks' results,
    with every phase of the step and the step's mean reward apart from the reward phase."""
    out = tmp_path / "replayed.md"
    tasks = REPO / "bench" / "results" / "train_step_rl_engines_tasks"
    cmd = [sys.executable, str(REPO / "bench" / "train_step.py"), "--replay", str(tasks), "--workdir", str(tmp_path / "work"),
           "--shapes", "sdar", "--parts", "rl-engines", "--side-by-side", "--no-cold", "--out", str(out)]
    r = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _table(out.read_text(), "## RL with lmdeploy rollouts")
    assert [row[1] for row in rows] == ["native", "lmdeploy"]
    for row in rows:
        phases, other, step_s = list(map(_number, row[3:9])), _number(row[9]), _number(row[10])
        assert abs(sum(phases) + other - step_s) <= 0.04 and 0 <= other < 1  # phases, the rest, the step (cells rounded)
        assert 0 < _number(row[11]) < 1  # the mean reward
    assert _number(rows[1][8]) > 0 and _number(rows[0][8]) == 0  # the weight push: lmdeploy's only
    assert _number(rows[1][-1]) == round(_number(rows[0][10]) / _number(rows[1][10]), 2)
    assert "(not recorded: rows read back" in out.read_text()


def test_no_ratio_against_d1_without_its_commit():
    """A d1 row whose checkout's commit is unknown (bench/.peers/d1 not a git checkout) says so, and no
    ratio is computed against it, in the table or the targets."""
    sys.path.insert(0, str(REPO / "bench"))
    from train_step_report import UNKNOWN_D1, rl_table, run_acceptance
    from train_step_runs import RL_PHASES

    ours = {"part": "rl", "shape": "llada", "recipe": "dare", "step": 2, "step_s": 10.0, "other": 0.0, "zero_std_ratio": 0.0,
            "peak_gib": 50.0, "d1_commit": None, **dict.fromkeys(RL_PHASES, 1.0)}
    d1 = {**ours, "part": "rl-d1", "recipe": "d1", "step": 1, "step_s": 80.0}
    table = "\n".join(rl_table([ours, d1]))
    assert "| d1's own code @unknown commit |" in table and UNKNOWN_D1 in table and "8.00x" not in table
    assert f"- RL step at LLaDA-8B vs d1's own code: {UNKNOWN_D1}" in run_acceptance([ours, d1])

    known = {**d1, "d1_commit": "837888f" + "0" * 33}
    table = "\n".join(rl_table([ours, known]))
    assert "| d1's own code @837888f |" in table and "8.00x" in table and "unknown" not in table
    assert "- RL step at LLaDA-8B vs d1's own code: 8.00x (target >= 10x, 8x the floor): not met (the 8x floor met)" \
        in run_acceptance([ours, known])
    # the compiled variant has a ratio and a target line of its own; SDAR's training pass has its MFU target
    compiled = {**ours, "compile": True, "step_s": 7.0}
    sdar = {**ours, "shape": "sdar", "train_mfu": 0.41}
    lines = run_acceptance([ours, compiled, known, sdar])
    assert "- RL step + compile at LLaDA-8B vs d1's own code: 11.43x (target >= 10x, 8x the floor): met" in lines
    assert "- SDAR-8B RL training pass (scoring + forward/backward): MFU 41.0% (target >= 40 %): met" in lines
    assert "| DARE + compile |" in "\n".join(rl_table([compiled]))


def test_rollout_share_of_peak_target_and_merged_label():
    sys.path.insert(0, str(REPO / "bench"))
    from train_step_report import rl_table, run_acceptance
    from train_step_runs import RL_PHASES

    ours = {"part": "rl", "shape": "llada", "recipe": "dare", "step": 2, "step_s": 10.0, "other": 0.0, "zero_std_ratio": 0.0,
            "peak_gib": 50.0, "rollout_peak": 0.561, "rollouts": 128, "lora_merged": True, **dict.fromkeys(RL_PHASES, 1.0)}
    assert "- rollout at LLaDA-8B (128 rollouts): 56.1% of bf16 peak (target >= 55 %): met" in run_acceptance([ours])
    low = {**ours, "compile": True, "rollout_peak": 0.5}
    assert "- rollout + compile at LLaDA-8B (128 rollouts): 50.0% of bf16 peak (target >= 55 %): not met" in run_acceptance([low])
    table = "\n".join(rl_table([ours]))
    assert "| DARE, merged-LoRA rollouts |" in table and "| 56.1% |" in table


def test_add_keeps_earlier_rows_only_from_the_same_gpus(tmp_path):
    """--add joins runs made one after the other on one machine: another GPU (a fresh machine of the
    same kind) starts a file of its own, so no ratio is taken across machines."""
    sys.path.insert(0, str(REPO / "bench"))
    from train_step_report import merge_previous

    run = {"commit": "c" * 40, "hardware": "NVIDIA H200 (140 GiB), 16 CPU cores", "settings": {"a": 1}, "gpus": ["GPU-1"]}
    path = tmp_path / "train_step.json"
    path.write_text(json.dumps({"runs": [run], "rows": [{"part": "rl-d1", "measured_in": 0}]}))
    assert merge_previous(path, dict(run), keep=True)["rows"] == [{"part": "rl-d1", "measured_in": 0}]
    assert merge_previous(path, {**run, "gpus": ["GPU-2"]}, keep=True) == {"runs": [], "rows": []}
    assert merge_previous(path, {**run, "commit": "d" * 40}, keep=True) == {"runs": [], "rows": []}
