"""Ulysses sequence parallelism in the training objectives, on the CPU: two gloo ranks of one
sequence-parallel group, each running half of every scoring stream, give the losses and gradients
one rank gives, for SFT, d1, CJ-GRPO (trajectory replay, also of rollouts with token editing), ESPO (proxy-gradient replay) and VRPO
with a LoRA adapter on the tiny LLaDA and SDAR (packed; SFT also padded; d1 also with chunked head
scores; SDAR's d1 also on rollouts that stop early, their canvas after the stop left out), and Dream's shifted scores across the ranks' edge. Started through torchrun like tests/sequence_parallel_ranks.py."""
import json

import pytest

from algo_helpers import make_algo
from dare_core.config import LaunchConfig, RLConfig, SamplerConfig
from dare_core.models.family import get_family
from dare_core.models.lm import build_model
from dare_core.training.parallel import check_sequence_parallel
from pipeline_helpers import two_cpu_ranks
from tiny_models import EOS, MASK, SMALL, VOCAB

# Tolerances (float32). The losses: every rank sums the same per-position scores (each position
# scored by one rank, zeros elsewhere) into the same [B, S] tensor, so the estimators see the
# one-rank scores; packed they come out equal, padded the slices' SDPA runs over a sequence padded
# to a multiple of the ranks, which may block its sums otherwise: observed 1.2e-7 of the loss,
# allowed 1e-6. The gradients: each rank back-propagates its own positions and the group sums them,
# in another order than one rank's backward: observed 9e-7 of the largest gradient (SDAR padded), allowed 4e-6.
LOSS_RTOL = 1e-6
GRADS_RTOL = 4e-6
SCORES_RTOL = 1e-6
CASES = ("llada/packed/sft", "llada/padded/sft", "sdar/packed/sft", "sdar/padded/sft", "llada/packed/d1",
         "llada/chunked/d1", "sdar/chunked/d1+lora", "sdar/packed/d1", "sdar/packed/d1+after_stop", "llada/packed/cj_grpo", "sdar/packed/cj_grpo",
         "sdar/packed/cj_grpo+edits", "llada/packed/espo",
         "sdar/packed/espo", "llada/packed/vrpo+lora", "sdar/packed/vrpo+lora")


@pytest.mark.timeout(180)
def test_two_sequence_parallel_ranks_train_as_one(tmp_path):
    two_cpu_ranks("sequence_parallel_losses_ranks.py", tmp_path, 170)
    errors = json.loads((tmp_path / "errors.json").read_text())
    for case in CASES:
        e = errors[case]
        print(case, e)
        assert e["loss_spread"] == 0.0, case  # the ranks of a group log one loss
        assert e["loss"] <= LOSS_RTOL * e["loss_scale"], case
        assert e["grads"] <= GRADS_RTOL * e["grad_scale"], case
        assert not e["missing"], case
    for packing in ("off", "on"):
        e = errors[f"Dream/{packing}"]
        assert e["scores"] <= SCORES_RTOL * e["scale"], packing


@pytest.mark.parametrize("family, heads, named", [
    ("llada", {"n_heads": 3, "n_kv_heads": 3, "d_model": 48}, "the number of attention heads, 3"),
    ("llada", {"n_kv_heads": 1}, "the number of key/value heads, 1"),
])
def test_a_group_that_cannot_split_the_heads_is_refused(family, heads, named):
    model = build_model(get_family(family).tiny_config(VOCAB, MASK, EOS, **{**SMALL[family], **heads}), device="meta")
    launch = LaunchConfig(launcher="torchrun", nproc=2, sequence_parallel=2)
    with pytest.raises(ValueError, match=r"launch.sequence_parallel \(2\) must divide") as e:
        check_sequence_parallel(launch, model)
    assert named in str(e.value)
    check_sequence_parallel(LaunchConfig(launcher="torchrun", nproc=2), model)  # 1: nothing to split


def test_an_algorithm_scoring_outside_token_logprobs_is_refused():
    """d-TreeRPO's distillation reads whole distributions from its own forward, which no group shards."""
    model = build_model(get_family("llada").tiny_config(VOCAB, MASK, EOS, **{**SMALL["llada"], "n_kv_heads": 2}))
    launch = LaunchConfig(launcher="torchrun", nproc=2, sequence_parallel=2)
    rl = RLConfig(group_size=4, sampler=SamplerConfig(gen_length=8, steps=8, block_length=8))
    tree = make_algo("d_tree_rpo", model, rl, num_tree_samples=2, branch_factor=2)
    with pytest.raises(ValueError, match=r"launch.sequence_parallel = 2: rl.algorithm 'd_tree_rpo' reads the model's logits"):
        check_sequence_parallel(launch, model, tree)
    check_sequence_parallel(launch, model, make_algo("d1", model, rl))
