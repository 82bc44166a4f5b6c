"""RL on several ranks (issue 18): every prompt of a step is rolled out on exactly one rank with all
its rows (group advantages over whole groups by construction), the ranks' shares of each mini-batch
together are the one-rank mini-batch, the step's metrics are reduced over the ranks (not rank 0's
half), and in-loop validation runs on every rank's share of the val prompts, ZeRO-3 included. A
1-rank and a 2-rank run (torchrun, gloo on the CPU) of the same SFT model log the same numbers."""
import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dare_core.config import DareConfig, LaunchConfig, RLConfig, load_config
from dare_core.data.prepare import prepare
from dare_core.training.rl.checks import check_rl_ranks
from dare_core.training.rl.ranks import combine_rank_metrics, rank_prompts
from dare_core.training.rl.validation import validation_share
from pipeline_helpers import dare, tiny_params, worker_env, write_params

# one-digit sums (as in test_rl_validation): after 700 SFT steps (~15 s) about a third to a half of
# the rollouts are right, so rewards, advantages and losses are not all 0
DATA = {"data__task_args": {"min_digits": 1, "max_digits": 1, "ops": "+", "zero_pad": True},
        "data__num_sft": 70, "data__num_rl": 20, "data__num_eval": 10, "data__num_val": 16}
VAL_KEYS = ("val/mean@4", "val/best@4", "val/maj@4")
# counts over the same rollouts (x / 16 rollouts, x / 4 groups; 0/1 rewards): the same numbers
COUNT_KEYS = ("reward", "accuracy", "extraction_failed", "response_tokens", "sequence_tokens", "rollout_steps",
              "zero_std_ratio")
# metrics.jsonl keeps 6 decimals: a mean of the groups' stds (float64, the ranks' means combined:
# ~1e-16 apart) may round either way; float32 sums of the update taken in another order (other
# micro-batches, the ranks' halves added last) are ~1e-7 relative apart, then rounded likewise
CLOSE_KEYS = {"reward_std": 1e-6, "loss": 1e-5, "approx_kl": 1e-5, "ratio": 1e-5, "clipfrac_hi": 1e-5, "clipfrac_lo": 1e-5}


# ---------------------------------------------------------------- the shares, no model


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_shares_partition_the_step_into_whole_groups(world):
    seen = 0
    for prompts in (2, 3, 4, 6, 8, 12):
        for mini_batches in (1, 2, 3, 4, 8):
            for per_prompt in (4, 6):  # G rollouts, or d-TreeRPO's transitions per prompt
                rl = RLConfig(prompts_per_step=prompts, group_size=4, mini_batches=mini_batches, micro_batch_size=1)
                rollouts = prompts * per_prompt
                if rollouts % mini_batches:
                    continue  # check_rl_config's refusal
                mini = rollouts // mini_batches
                cfg = DareConfig(rl=rl)
                if prompts % world or mini % world:
                    with pytest.raises(ValueError, match=f"must be divisible by the {world} ranks"):
                        _check_ranks(cfg, per_prompt, world)
                    continue
                _check_ranks(cfg, per_prompt, world)
                seen += 1
                shares = [rank_prompts(prompts, mini_batches, r, world) for r in range(world)]
                # every prompt on exactly one rank, as many on each
                assert sorted(p for s in shares for p in s) == list(range(prompts))
                assert {len(s) for s in shares} == {prompts // world}
                # a rank's rows are its prompts' rows, prompt by prompt: a group never spans ranks
                rows = [[p * per_prompt + g for p in s for g in range(per_prompt)] for s in shares]
                owner = {row: r for r, rs in enumerate(rows) for row in rs}
                assert len(owner) == rollouts
                for p in range(prompts):
                    assert len({owner[p * per_prompt + g] for g in range(per_prompt)}) == 1
                # the loop's mini-batches: every rank walks mini_batches slices of its rows in step
                local = rollouts // world // mini_batches
                parts = [[set(rs[m * local:(m + 1) * local]) for rs in rows] for m in range(mini_batches)]
                assert sorted(row for part in parts for rs in part for row in rs) == list(range(rollouts))
                if prompts % mini_batches == 0 and (prompts // mini_batches) % world == 0:
                    # whole prompts per mini-batch, shared out evenly: the one-rank mini-batches
                    for m, part in enumerate(parts):
                        assert set().union(*part) == set(range(m * mini, (m + 1) * mini)), (prompts, mini_batches, m)
    assert seen


def _check_ranks(cfg: DareConfig, per_prompt: int, world: int) -> None:
    import os

    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        check_rl_ranks(cfg, per_prompt)
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def test_prompts_per_step_not_divisible_by_the_ranks_is_refused_and_zero3_validation_is_not():
    with pytest.raises(ValueError, match=r"rl.prompts_per_step = 6 .* must be divisible by the 4 ranks"):
        _check_ranks(DareConfig(rl=RLConfig(prompts_per_step=6, group_size=4)), 4, 4)
    zero3 = DareConfig(rl=RLConfig(prompts_per_step=4, group_size=4, validate_every=1), launch=LaunchConfig(zero_stage=3))
    _check_ranks(zero3, 4, 2)


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_validation_shares_cover_every_prompt_once_and_are_padded_to_one_length(n):
    for world in (1, 2, 3, 4):
        shares = [validation_share(n, r, world) for r in range(world)]
        assert {len(s) for s in shares} == {-(-n // world)}  # the same sampling calls on every rank
        assert sorted(i for s in shares for i in s if i is not None) == list(range(n))


def test_rank_metrics_combine_into_the_one_rank_numbers():
    rewards = [0.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    one = {"reward": sum(rewards) / 12, "rollout_nfe": 8, "lr": 1e-4, "step_time_s": 3.0}
    halves = [rewards[:6], rewards[6:]]
    parts = [{"prompts": 3, "metrics": {"reward": sum(h) / 6, "rollout_nfe": 4, "lr": 1e-4, "step_time_s": t},
              "updates": {"approx_kl": (0.5 * 6, 6), "ratio_max": (t * 10, 1.0), **({"sd_kl": (1.0, 2)} if t > 2 else {})},
              "loss": 0.25}
             for h, t in zip(halves, (2.0, 3.0))]
    out = combine_rank_metrics(parts, loss_terms=2)
    assert math.isclose(out["reward"], one["reward"], rel_tol=1e-15)
    assert out["rollout_nfe"] == 8 and out["lr"] == 1e-4 and out["step_time_s"] == 3.0  # sum, same, slowest
    assert out["loss"] == 0.25 and out["approx_kl"] == 0.5 and out["sd_kl"] == 0.5  # sd_kl: the rank that has it
    assert out["ratio_max"] == 30.0  # the largest ratio of any rank, not a mean
    # one rank: its metrics as they are
    assert combine_rank_metrics([{"prompts": 6, "metrics": one}])["reward"] == one["reward"]


# ---------------------------------------------------------------- 1 rank against 2 ranks


def _run(params: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(dare("stage", "rl", "--params", str(params), *extra), env=worker_env(), capture_output=True,
                          text=True, timeout=900)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    params = write_params(root / "params.yaml", tiny_params(root, **DATA, sft__max_steps=700))
    prepare(load_config(params))
    r = subprocess.run(dare("stage", "sft", "--params", str(params)), env=worker_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def _rl(sft_run: Path, dest: Path, **over) -> tuple[list[dict], list[dict], float]:
    """Metrics and validation rows of a 3-step RL run, 2 mini-batches, validated at every step (one
    thread per rank: the same float sums), and its wall time."""
    shutil.copytree(sft_run / "data", dest / "data")
    shutil.copytree(sft_run / "runs" / "t" / "sft", dest / "runs" / "t" / "sft")
    over = {**DATA, "rl__num_steps": 3, "rl__mini_batches": 2, "rl__validate_every": 1, "rl__validate_k": 4,
            "launch__threads": 1, "launch__timeout_s": 180, **over}
    params = write_params(dest / "params.yaml", tiny_params(dest, **over))
    t0 = time.time()
    r = _run(params)
    assert r.returncode == 0, r.stderr[-12000:]
    out = dest / "runs" / "t" / "rl"
    return _jsonl(out / "metrics.jsonl"), _jsonl(out / "validation.jsonl"), time.time() - t0


@pytest.fixture(scope="module")
def one_rank(sft_run, tmp_path_factory):
    return _rl(sft_run, tmp_path_factory.mktemp("rank1"))


def _compare(one: tuple, two: tuple) -> None:
    (m1, v1, _), (m2, v2, _) = one, two
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [0, 1, 2, 3]
    assert [v["step"] for v in v1] == [v["step"] for v in v2] == [0, 1, 2, 3]
    # validation: the same samples graded, scores summed in prompt order -> the same bits
    for a, b in zip(v1, v2):
        assert [a[k] for k in ("mean@4", "best@4", "maj@4", "prompts")] == [b[k] for k in ("mean@4", "best@4", "maj@4", "prompts")]
    assert [[m[k] for k in VAL_KEYS] for m in m1] == [[m[k] for k in VAL_KEYS] for m in m2]
    assert any(v["best@4"] > 0 for v in v1)
    for a, b in zip(m1[1:], m2[1:]):
        for key in COUNT_KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        for key, tol in CLOSE_KEYS.items():
            assert math.isclose(a[key], b[key], rel_tol=tol, abs_tol=tol), (a["step"], key, a[key], b[key])
    # a run with something to compare: rewards neither all 0 nor all 1, a loss that is not 0
    assert all(0 < m["accuracy"] < 1 for m in m1[1:]) and all(m["loss"] != 0 for m in m1[1:])


def test_two_ranks_log_the_one_rank_metrics_and_validation(sft_run, one_rank, tmp_path):
    two = _rl(sft_run, tmp_path, launch__launcher="torchrun", launch__nproc=2)
    print(f"1 rank {one_rank[2]:.1f}s, 2 ranks {two[2]:.1f}s")
    _compare(one_rank, two)


def test_two_ranks_zero3_validate_without_hanging(sft_run, one_rank, tmp_path):
    two = _rl(sft_run, tmp_path, launch__launcher="torchrun", launch__nproc=2, launch__zero_stage=3)
    print(f"1 rank {one_rank[2]:.1f}s, 2 ranks ZeRO-3 {two[2]:.1f}s")
    _compare(one_rank, two)
