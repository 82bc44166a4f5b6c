"""rl.schedule: one_step_off_policy trains on rollouts drawn a step earlier (so its ratios are to
the behaviour policy, not 1), and a run killed after a checkpoint resumes, from the rollouts the
checkpoint kept, to exactly the metrics and weights of an uninterrupted run; so does a schedule
that keeps two rollouts ahead, declared by a test alone (a record and its walk, no stage code)."""
import json
import subprocess
import sys

import pytest

from dare_core.rl_schedules import RL_SCHEDULES, ScheduleRecord
from dare_core.training.rl.schedules import SCHEDULES, walks
from pipeline_helpers import tiny_params, worker_env, write_params

_RUN = r"""
import json, shutil, sys
import torch
from dare_core.config import load_config
from dare_core.data.prepare import prepare
from dare_core.rl_schedules import ScheduleRecord, declare
from dare_core.training.rl import loop as rl_loop, schedules as rl_schedules, verbs as rl_verbs
from dare_core.training.checkpoint import CheckpointManager
from dare_core.training.sft_loop import run_sft

# a schedule of this test's own: step t trains on rollouts collected two steps earlier
declare(ScheduleRecord("two_steps_off_policy", keeps_ahead=2, skips_old_scores=False, in_fingerprint=True,
                       records_behaviour=True))
rl_schedules.walks("two_steps_off_policy")(rl_schedules.off_policy)

torch.set_num_threads(1)
cfg = load_config(sys.argv[1])
kill_after = int(sys.argv[2])
prepare(cfg)
run_sft(cfg, progress=False, save_checkpoints=False)


class Killed(Exception):
    pass


after_step = CheckpointManager.after_step
kept = []


def killed_after_step(self, engine, step, hf_config, rank_files=None):
    after_step(self, engine, step, hf_config, rank_files)
    if step == kill_after:
        kept.extend(sorted(p.name for p in (self.dir / f"step{step:08d}").glob("rollout_ahead*")))
        raise Killed


ratios = []
update = rl_schedules.optimize


def spy(run, rollout, scores):  # the behaviour scores differ from the weights the update starts at
    with torch.no_grad():
        now = rl_verbs.score(run, rollout, ref=False).old
    ratios.append(not all(torch.equal(a, b) for a, b in zip(now, scores.old)))
    return update(run, rollout, scores)


rl_schedules.optimize = spy
out = {}
for name in ("whole", "killed"):
    shutil.copytree(cfg.stage_dir("sft"), cfg.run_dir.parent / name / "sft")
    cfg.run.name = name
    if name == "killed":
        CheckpointManager.after_step = killed_after_step
        try:
            rl_loop.run_rl(cfg, progress=False)
        except Killed:
            pass
        CheckpointManager.after_step = after_step
    rl_loop.run_rl(cfg, progress=False)
    rows = [json.loads(l) for l in (cfg.stage_dir("rl") / "metrics.jsonl").read_text().splitlines()]
    last = sorted(cfg.stage_dir("rl").glob("checkpoints/step*"))[-1]
    state = torch.load(next(last.rglob("*model_states.pt")), weights_only=False)["module"]
    out[name] = {"metrics": [{k: v for k, v in r.items() if "time" not in k and not k.endswith("_per_s")} for r in rows],
                 "weights": float(sum(v.double().abs().sum() for v in state.values()))}
print("OUT " + json.dumps({"runs": out, "ratios": ratios, "kept": kept}))
"""


def _killed_and_whole(tmp_path, schedule: str, num_steps: int, kill_after: int) -> dict:
    """An uninterrupted run of `schedule` and one killed after the checkpoint of step `kill_after`
    and resumed; the entropy bonus moves the weights every step (the tiny model's rewards may all be 0)."""
    params = tiny_params(tmp_path, sft__max_steps=2, rl__num_steps=num_steps, rl__schedule=schedule,
                         rl__num_iterations=1, rl__kl_beta=0.05, rl__entropy_coeff=0.01, rl__save_every=1, rl__log_every=1,
                         rl__validate_every=0)
    path = write_params(tmp_path / "params.yaml", params)
    r = subprocess.run([sys.executable, "-c", _RUN, str(path), str(kill_after)], env=worker_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("OUT "))[4:])


def test_every_schedule_record_has_its_walk_and_every_walk_its_record():
    assert set(SCHEDULES) == set(RL_SCHEDULES)
    with pytest.raises(ValueError, match="unknown RL schedule 'no_such_schedule'"):
        walks("no_such_schedule")


def test_a_schedule_that_keeps_rollouts_ahead_records_their_behaviour_scores():
    with pytest.raises(ValueError, match="keeps 1 rollouts ahead"):
        ScheduleRecord("ahead_but_on_policy", keeps_ahead=1, skips_old_scores=True, in_fingerprint=True, records_behaviour=True)


def test_one_step_off_policy_runs_and_resumes_identically(tmp_path):
    out = _killed_and_whole(tmp_path, "one_step_off_policy", num_steps=3, kill_after=2)
    whole, killed = out["runs"]["whole"], out["runs"]["killed"]
    assert [m["step"] for m in whole["metrics"]] == [1, 2, 3]
    # the killed run logged steps 1-2, then its resumed run step 3: the same rows as the whole run
    assert killed == whole
    # the checkpoint of step 2 kept the rollout of step 2 under the name of checkpoints made before
    # schedules could keep more than one
    assert out["kept"] == ["rollout_ahead_rank000.pt"]
    # step 0 trains on its own weights' rollouts; steps 1 and 2 on those of the weights a step older
    # (whole run: 3 updates; killed: 2 + the resumed 1)
    assert out["ratios"] == [False, True, True, False, True, True]


def test_two_rollouts_ahead_resume_identically(tmp_path):
    out = _killed_and_whole(tmp_path, "two_steps_off_policy", num_steps=4, kill_after=1)
    whole, killed = out["runs"]["whole"], out["runs"]["killed"]
    assert [m["step"] for m in whole["metrics"]] == [1, 2, 3, 4]
    # killed after step 1, its checkpoint kept the rollouts of steps 1 and 2; resumed, it logged
    # steps 2-4 as the whole run did
    assert out["kept"] == ["rollout_ahead1_rank000.pt", "rollout_ahead_rank000.pt"]
    assert killed == whole
    # step 0 trains on its own weights' rollouts, every later step on older weights' (whole: 4
    # updates; killed: 1 + the resumed 3)
    assert out["ratios"] == [False, True, True, True, False, True, True, True]


_FIRST_OLD = r"""
import json, shutil, sys
import torch
from dare_core.config import load_config
from dare_core.data.prepare import prepare
from dare_core.training.rl import loop as rl_loop, schedules as rl_schedules, verbs as rl_verbs
from dare_core.training.sft_loop import run_sft

torch.set_num_threads(1)
cfg = load_config(sys.argv[1])
prepare(cfg)
run_sft(cfg, progress=False, save_checkpoints=False)
scored, score = [], rl_verbs.chunked_scores


def counted(algo, model, batch, corruption, rows):
    scored.append(-(-len(batch) // rows))  # forwards: one a chunk of `rows` sequences
    return score(algo, model, batch, corruption, rows)


rl_verbs.chunked_scores = counted
out = {}
for name, skip in (("skip", True), ("scored", False)):
    shutil.copytree(cfg.stage_dir("sft"), cfg.run_dir.parent / name / "sft")
    cfg.run.name = name
    rl_schedules.first_iteration_is_current = lambda rl, skip=skip: skip
    scored.clear()
    rl_loop.run_rl(cfg, progress=False)
    rows = [json.loads(l) for l in (cfg.stage_dir("rl") / "metrics.jsonl").read_text().splitlines()]
    out[name] = {"forwards": sum(scored), "calls": len(scored), "metrics": [{k: v for k, v in r.items() if isinstance(v, float) and "time" not in k
                                                       and not k.endswith("_per_s")} for r in rows]}
print("OUT " + json.dumps(out))
"""


def test_on_policy_first_iteration_reads_its_own_scores_as_old(tmp_path):
    """On-policy, the first inner iteration's old scores are the update's own (the weights have not
    stepped yet): one scoring forward fewer per step than scoring them, and the same run to float
    rounding (the scored ones equal the update's own scores)."""
    # the entropy bonus moves the weights in the first iteration, so the second one's ratios are not 1
    params = tiny_params(tmp_path, sft__max_steps=2, rl__num_steps=2, rl__num_iterations=2, rl__mini_batches=1,
                         rl__kl_beta=0.05, rl__entropy_coeff=0.01, rl__log_every=1, rl__validate_every=0,
                         rl__save_every=100)
    path = write_params(tmp_path / "params.yaml", params)
    r = subprocess.run([sys.executable, "-c", _FIRST_OLD, str(path)], env=worker_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("OUT "))[4:])
    skip, scored = out["skip"], out["scored"]
    # per step: old and reference scores of 2 iterations, less the first iteration's old ones
    assert (scored["calls"], skip["calls"]) == (2 * 4, 2 * 3)
    assert skip["forwards"] == scored["forwards"] * 3 // 4
    assert len(skip["metrics"]) == len(scored["metrics"]) == 2
    assert all(m["approx_kl"] != 0 for m in scored["metrics"])  # the second iteration reads stepped weights' scores
    for a, b in zip(skip["metrics"], scored["metrics"]):
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, a[k], b[k])
