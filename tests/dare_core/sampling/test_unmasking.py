"""Unmasking policies, schedules and proposals (docs/sampling.md#low-confidence-remasking, docs/sampling.md#dream-variants, docs/sampling.md#fast-dllm-caches, docs/sampling.md#block-diffusion-decoding)."""
import pytest
import torch

from dare_core.diffusion.seeding import sample_generators
from dare_core.sampling.decode import generate
from dare_core.sampling.params import SamplingParams
from dare_core.sampling.unmasking import (
    StepContext,
    StepScores,
    build_unmasker,
    filtered_logits,
    scheduled_counts,
)
from tiny_models import tiny

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]


def select(unmasking: str, conf, is_masked=None, entropy=None, j=0, **kw):
    conf = torch.tensor(conf, dtype=torch.float32)[None]
    is_masked = torch.ones_like(conf, dtype=torch.bool) if is_masked is None else torch.tensor(is_masked)[None]
    params = SamplingParams(gen_length=conf.shape[1], block_length=conf.shape[1], steps=kw.pop("steps", conf.shape[1]), unmasking=unmasking, **kw)
    scores = StepScores(torch.zeros_like(conf, dtype=torch.long), conf, None if entropy is None else torch.tensor(entropy)[None])
    ctx = StepContext(params, j, is_masked.sum(-1))
    return build_unmasker(params).select(scores, is_masked, ctx)[0].tolist()


def test_threshold_commits_all_above_and_always_the_top1():
    assert select("threshold", [0.95, 0.5, 0.91, 0.2], threshold=0.9) == [True, False, True, False]
    assert select("threshold", [0.3, 0.5, 0.1, 0.2], threshold=0.9) == [False, True, False, False]
    # only masked positions, even when an unmasked one is the most confident
    assert select("threshold", [0.99, 0.5, 0.1, 0.2], is_masked=[False, True, True, True], threshold=0.9) == [False, True, False, False]
    assert select("threshold", [0.3, 0.5, 0.1, 0.2], threshold=0.0) == [True] * 4


def test_factor_rule_by_hand():
    # sorted c = .99 .97 .9 .5: n=1: 2*.01=.02<1; n=2: 3*.03=.09; n=3: 4*.1=.4; n=4: 5*.5=2.5 >= 1
    assert select("factor", [0.9, 0.99, 0.5, 0.97], factor=1.0) == [True, True, False, True]
    assert select("factor", [0.9, 0.99, 0.5, 0.97], factor=0.05) == [False, True, False, False]
    assert select("factor", [0.1, 0.2, 0.3, 0.25], factor=1e-9) == [False, False, True, False]  # f -> 0: exactly one


def test_entropy_bounded_commits_in_ascending_entropy_within_the_budget():
    entropy = [0.3, 0.05, 0.2, 0.1]
    assert select("entropy_bounded", [0.1] * 4, entropy=entropy, entropy_bound=0.35) == [False, True, True, True]
    assert select("entropy_bounded", [0.1] * 4, entropy=entropy, entropy_bound=0.0) == [False, True, False, False]


def test_dynamic_falls_back_to_the_top_k_schedule():
    # block of 4 over 2 steps: k_0 = 2; one position above 0.9 -> the top 2 instead
    assert select("dynamic", [0.95, 0.5, 0.6, 0.2], steps=2, threshold=0.9) == [True, False, True, False]
    assert select("dynamic", [0.95, 0.93, 0.92, 0.2], steps=2, threshold=0.9) == [True, True, True, False]


def test_sequential_is_left_to_right():
    assert select("sequential", [0.1, 0.9, 0.8, 0.7], is_masked=[False, True, True, True], steps=2) == [False, True, True, False]


def test_topk_never_selects_unmasked_positions_when_k_exceeds_the_masked_count():
    # block of 4 in one step commits all 4... but two of them are the prompt tail
    assert select("topk", [0.9, 0.8, 0.1, 0.2], is_masked=[False, False, True, True], steps=1) == [False, False, True, True]


def test_schedules():
    for m in range(0, 33):
        for s in (1, 2, 4, 8):
            p = SamplingParams(gen_length=32, block_length=32, steps=s)
            k = [scheduled_counts(p, torch.tensor([m]), torch.tensor([m]), j).item() for j in range(s)]
            assert sum(k) == m and max(k) - min(k) <= 1
    # Dream: floor(m (1 - s/t)) of what is still masked, everything at the last step
    p = SamplingParams(gen_length=8, block_length=8, steps=4, schedule="dream")
    left = torch.tensor([8])
    total = 0
    for j in range(4):
        k = scheduled_counts(p, torch.tensor([8]), left, j)
        total += int(k)
        left = left - k
    assert total == 8 and int(left) == 0


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filtered_logits(logits, 0.0, top_k=2)).tolist() == [[False, False, True, True]]
    p = torch.softmax(logits, -1)[0]  # .644 .237 .087 .032
    kept = ~torch.isinf(filtered_logits(logits, 1.0, top_p=float(p[0] + 0.01)))
    assert kept.tolist() == [[True, True, False, False]]
    assert (~torch.isinf(filtered_logits(logits, 1.0, top_p=0.5))).tolist() == [[True, False, False, False]]


@pytest.fixture(scope="module")
def model():
    return tiny("llada").double()


def test_threshold_above_every_confidence_equals_top1_decoding(model):
    one_per_step = SamplingParams(gen_length=8, steps=8, block_length=4, stop_at_eos=False)
    threshold = SamplingParams(gen_length=8, steps=2, block_length=4, unmasking="threshold", threshold=1.01, stop_at_eos=False)
    a = generate(model, PROMPTS, one_per_step, record="steps")
    b = generate(model, PROMPTS, threshold, record="steps")
    assert torch.equal(a.sequences, b.sequences)
    assert b.steps.tolist() == [8, 8, 8]


def test_threshold_zero_commits_a_block_per_step(model):
    out = generate(model, PROMPTS, SamplingParams(gen_length=8, steps=8, block_length=4, unmasking="threshold", threshold=0.0, stop_at_eos=False), record="steps")
    assert out.steps.tolist() == [2, 2, 2]
    assert out.step_map.tolist() == [[1] * 4 + [2] * 4] * 3


def test_block_length_one_is_left_to_right(model):
    out = generate(model, PROMPTS, SamplingParams(gen_length=6, steps=6, block_length=1, stop_at_eos=False), record="steps")
    assert out.step_map.tolist() == [[1, 2, 3, 4, 5, 6]] * 3


@pytest.mark.parametrize("unmasking,extra", [
    ("topk", {}), ("threshold", {"threshold": 0.2}), ("dynamic", {"threshold": 0.2}), ("factor", {"factor": 2.0}),
    ("entropy_bounded", {"entropy_bound": 2.0}), ("sequential", {}), ("origin", {}),
    ("topk", {"remasking": "topk_margin", "schedule": "dream"}), ("topk", {"remasking": "entropy", "schedule": "dream"}),
    ("topk", {"remasking": "maskgit_plus", "alg_temp": 0.5}), ("topk", {"remasking": "random"}),
])
def test_every_policy_decodes_every_position_and_never_changes_a_commit(model, unmasking, extra):
    params = SamplingParams(gen_length=8, steps=4, block_length=4, unmasking=unmasking, temperature=0.7, top_p=0.9, stop_at_eos=False, **extra)
    out = generate(model, PROMPTS, params, generators=sample_generators((1,), ["a", "b", "c"]), record="full")
    traj = out.trajectory
    assert not (traj.tokens == model.mask_token_id).any()
    traj.validate(torch.ones_like(traj.step_map, dtype=torch.bool), allow_empty_steps=extra.get("schedule") == "dream" or unmasking == "origin")
    for b in range(len(PROMPTS)):
        states = list(traj.states(b))
        for k, (before, after) in enumerate(zip(states, states[1:] + [traj.tokens[b]])):
            known = before != model.mask_token_id
            assert torch.equal(before[known], after[known])
            # what step k+1 committed is the proposal recorded at that step
            new = known.logical_not() & (after != model.mask_token_id)
            assert torch.equal(traj.x0_hat[b, k][new].long(), after[new])


def test_config_names_are_exactly_the_registered_policies():
    """params.py lists the names (the config schema cannot import torch); the registries implement them."""
    from dare_core.sampling.cache import CACHE_POLICIES
    from dare_core.sampling.params import CACHES, UNMASKING
    from dare_core.sampling.unmasking import UNMASKERS

    assert set(UNMASKING) == set(UNMASKERS)
    assert set(CACHES) == set(CACHE_POLICIES)
