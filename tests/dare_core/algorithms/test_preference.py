"""ELBO-DPO and VRPO (docs/algorithms.md#preference-optimisation): the exact zero logit at initialisation under shared masks,
the zero gradient of an identical pair, the variance reduction of antithetic masks, invariance to
pair order and micro-batch split, the exact proxy-gradient replay, and the seeding discipline."""
import copy
import hashlib
import math
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_llada
from dare_core.algorithms.preference import (
    VRPO,
    ElboDPO,
    build_preference,
    get_preference,
)
from dare_core.algorithms.registry import PREFERENCE_OBJECTIVES
from dare_core.config import ConfigError, PreferenceConfig
from dare_core.training.reference import reference_model
from dare_core.data.batching import pair_batch
from dare_core.diffusion.likelihood import elbo_rows
from dare_core.diffusion.masking import CorruptionSet

PAD_TO = 6
# prompts of different lengths (different left padding per micro-batch), responses of different lengths
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]
CHOSEN = [[20, 21], [22, 23, 24], [25], [26, 27, 28, 29]]
REJECTED = [[20, 22], [22], [30, 31, 32], [26, 27, 33]]
UIDS = ["p0", "p1", "p2", "p3"]


def _objective(model, algorithm="vrpo", **kw):
    return build_preference(PreferenceConfig(algorithm=algorithm, pad_to=PAD_TO, **kw), model)


def _batch(model, idx=range(4), chosen=CHOSEN, rejected=REJECTED):
    idx = list(idx)
    return pair_batch([PROMPTS[i] for i in idx], [chosen[i] for i in idx], [rejected[i] for i in idx], [UIDS[i] for i in idx],
                      PAD_TO, model.eos_token_id, model.pad_token_id)


def _perturbed(model, seed=0, scale=0.02):
    """A policy that is no longer the reference."""
    policy = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return policy


def _step(obj, policy, ref, batch, seed_base, n_pairs=None, backward=True, share_pair=False):
    corr = obj.corrupt(batch, seed_base, share_pair=share_pair)
    r = obj.reference_elbos(ref, batch, corr)
    out = obj.update(policy, batch, corr, r, n_pairs or len(batch) // 2, (lambda loss: loss.backward()) if backward else (lambda loss: None))
    return out


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------- registry and config


def test_objectives_are_registered_apart_from_rl_and_configured_by_name():
    from dare_core.algorithms.registry import RL_ALGORITHMS, SFT_OBJECTIVES

    # one registry per kind: SFT is no RL algorithm, neither is a preference objective
    assert get_preference("vrpo") is VRPO and get_preference("elbo_dpo") is ElboDPO
    assert set(PREFERENCE_OBJECTIVES) == {"vrpo", "elbo_dpo"} and set(SFT_OBJECTIVES) == {"sft", "uniform_sft"}
    assert not (set(PREFERENCE_OBJECTIVES) | set(SFT_OBJECTIVES)) & set(RL_ALGORITHMS)
    with pytest.raises(ValueError, match=r"unknown preference algorithm 'dpo'; known: \['elbo_dpo', 'vrpo'\]"):
        get_preference("dpo")
    model = make_tiny_llada()
    vrpo, plain = _objective(model), _objective(model, "elbo_dpo")
    assert (vrpo.shared_masks, vrpo.stratified, plain.shared_masks, plain.stratified) == (True, True, False, False)
    ablation = _objective(model, shared_masks=False)
    assert type(ablation) is VRPO and not ablation.shared_masks and ablation.stratified
    assert vrpo.z == PAD_TO and _objective(model, elbo_norm="none").z == 1.0
    with pytest.raises(ValueError, match="elbo_norm"):
        _objective(model, elbo_norm="valid")
    with pytest.raises(ConfigError, match="preference.mc_num"):
        build_preference(PreferenceConfig(mc_num="four"), model)


def test_pair_batch_layout():
    model = make_tiny_llada()
    b = _batch(model)
    assert len(b) == 8 and b.uids == [u for u in UIDS for _ in range(2)]
    P = b.prompt_len
    assert b.input_ids.shape[1] == P + PAD_TO
    for k in range(4):  # one prompt per pair, chosen at 2k, rejected at 2k+1, EOS-padded canvas
        assert torch.equal(b.input_ids[2 * k, :P], b.input_ids[2 * k + 1, :P])
        assert b.input_ids[2 * k, P:P + len(CHOSEN[k])].tolist() == CHOSEN[k]
        assert b.input_ids[2 * k + 1, P:P + len(REJECTED[k])].tolist() == REJECTED[k]
    assert (b.input_ids[0, P + 2:] == model.eos_token_id).all()


# --------------------------------------------------------------------------- at initialisation


def test_shared_masks_give_a_zero_logit_and_log2_loss_for_every_draw():
    model = make_tiny_llada()
    ref = copy.deepcopy(model)
    obj = _objective(model)
    b = _batch(model)
    log2 = torch.log(torch.tensor(2.0))
    for seed in range(12):
        out = _step(obj, model, ref, b, (seed, 3), backward=False)
        assert out.logits.dtype == torch.float32
        assert torch.equal(out.logits, torch.zeros(4))  # exactly: bitwise equal ELBOs
        assert torch.equal(-F.logsigmoid(out.logits), log2.expand(4))
        assert out.loss.item() == pytest.approx(math.log(2), abs=1e-7)
        assert out.metrics == {"reward_margin": 0.0, "reward_accuracy": 0.0, "pairs": 4.0}


def test_independent_reference_masks_give_a_nonzero_varying_logit_at_initialisation():
    model = make_tiny_llada()
    ref = copy.deepcopy(model)
    for obj in (_objective(model, "elbo_dpo"), _objective(model, shared_masks=False)):
        logits = torch.stack([_step(obj, model, ref, _batch(model), (seed, 3), backward=False).logits for seed in range(12)])
        assert (logits != 0).all()
        assert (logits.std(0) > 1e-3).all()  # varies across mask draws


def test_lora_reference_is_the_adapter_disabled_policy():
    from dare_core.models.lora import LoraSettings, apply_lora

    model = make_tiny_llada()
    apply_lora(model, LoraSettings(r=4, alpha=8))  # fresh adapter: B = 0, policy = reference
    obj = _objective(model)
    b = _batch(model)
    model.train()
    for seed in range(4):
        corr = obj.corrupt(b, (seed, 0))
        with reference_model(model, None) as ref:
            assert ref is model and not model.training
            r = obj.reference_elbos(ref, b, corr)
        assert model.training  # restored
        out = obj.update(model, b, corr, r, 4, lambda loss: loss.backward())
        assert torch.equal(out.logits, torch.zeros(4))
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    # once the adapter moved, the adapter-disabled reference differs from the policy
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    corr = obj.corrupt(b, (0, 0))
    with reference_model(model, None) as ref:
        r = obj.reference_elbos(ref, b, corr)
    assert (obj.update(model, b, corr, r, 4, lambda loss: None).logits != 0).all()


def test_identical_responses_with_masks_shared_across_the_pair_have_zero_gradient():
    model = make_tiny_llada().double()
    ref = model
    policy = _perturbed(model)
    obj = _objective(model)
    same = _batch(model, rejected=CHOSEN)
    out = _step(obj, policy, ref, same, (0, 1), share_pair=True)
    assert torch.equal(out.logits, torch.zeros(4))
    zero = max(g.abs().max().item() for g in _grads(policy).values())
    # the same pairs with distinct responses: a real gradient, for scale
    policy.zero_grad()
    _step(obj, policy, ref, _batch(model), (0, 1), share_pair=True)
    scale = max(g.abs().max().item() for g in _grads(policy).values())
    assert scale > 1e-4
    # zero up to float64 round-off: the two rows' opposite contributions meet inside GEMM sums
    assert zero <= 1e-12 * scale
    # with the usual independent masks for chosen and rejected, the identical pair does move
    policy.zero_grad()
    out = _step(obj, policy, ref, same, (0, 1))
    assert (out.logits != 0).all()


# --------------------------------------------------------------------------- variance


def _score_draws(obj, policy, ref, batch, seeds):
    """B_theta - B_ref for each sequence and seed: [seeds, 2P] (all draws in one forward per model)."""
    corrs = [obj.corrupt(batch, (s, 0)) for s in seeds]
    n = obj.options.mc_num

    def elbos(model, sets):
        rows = [r for cs in sets for r in cs.rows]
        with torch.no_grad():
            e = elbo_rows(model, rows, batch.input_ids, batch.attention_mask) / obj.z  # [2P, seeds * n]
        return e.view(len(batch), len(seeds), n).mean(-1).T

    return elbos(policy, [c.policy for c in corrs]) - elbos(ref, [c.reference for c in corrs])


def test_shared_masks_reduce_the_variance_of_the_score_difference_after_one_sgd_step():
    torch.manual_seed(0)
    model = make_tiny_llada()
    ref = copy.deepcopy(model)
    policy = copy.deepcopy(model)
    b = _batch(model)
    shared = _objective(model)  # N = n_t = 4 stratified timesteps, one mask each
    independent = _objective(model, shared_masks=False)
    # one SGD step away from the reference (at theta = ref the shared difference is exactly 0)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    out = _step(shared, policy, ref, b, (12345, 0))
    opt.step()
    assert out.loss.item() == pytest.approx(math.log(2), abs=1e-6)
    seeds = range(200)
    d_shared = _score_draws(shared, policy, ref, b, seeds)
    d_indep = _score_draws(independent, policy, ref, b, seeds)
    assert (d_shared != 0).any()  # the policy did move
    var_shared, var_indep = d_shared.var(0), d_indep.var(0)
    # for every sequence, and on average by more than 10x (measured: ~40x)
    assert (var_shared < 0.5 * var_indep).all(), var_shared / var_indep
    assert var_shared.mean() < 0.1 * var_indep.mean(), (var_shared.mean(), var_indep.mean())
    # both estimate the same mean difference
    se = ((var_indep + var_shared) / 200).sqrt()
    assert ((d_shared.mean(0) - d_indep.mean(0)).abs() < 5 * se).all()


def test_vrpo_counts_are_stratified_and_elbo_dpo_counts_independent():
    model = make_tiny_llada()
    b = _batch(model, chosen=[[20, 21, 22]] * 4, rejected=[[23, 24, 25]] * 4)  # |V| = 4 (3 tokens + EOS)
    vrpo, plain = _objective(model, mc_num=4), _objective(model, "elbo_dpo", mc_num=4)
    repeats = 0
    for seed in range(30):
        counts = torch.stack([r.scored.sum(-1) for r in vrpo.corrupt(b, (seed, 0)).policy.rows], 1)  # [2P, N]
        assert (counts.sort(1).values == torch.arange(1, 5)).all()  # n = N: every count once
        plain_counts = torch.stack([r.scored.sum(-1) for r in plain.corrupt(b, (seed, 0)).policy.rows], 1)
        assert ((plain_counts >= 1) & (plain_counts <= 4)).all()
        repeats += int(sum(len(set(row.tolist())) < 4 for row in plain_counts))
    assert repeats > 0  # i.i.d. counts repeat, stratified ones never do


def test_elbo_norm_fixed_divides_by_the_configured_length():
    model = make_tiny_llada()
    policy = _perturbed(model)
    b = _batch(model)
    fixed = _step(_objective(model), policy, model, b, (0, 0), backward=False).logits
    none = _step(_objective(model, elbo_norm="none"), policy, model, b, (0, 0), backward=False).logits
    torch.testing.assert_close(none, fixed * PAD_TO, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- invariance and exactness


@pytest.mark.parametrize("algorithm", ["vrpo", "elbo_dpo"])
def test_loss_and_gradient_invariant_to_pair_order_and_micro_batch_split(algorithm):
    model = make_tiny_llada()
    policy = _perturbed(model, scale=0.05)
    obj = _objective(model, algorithm)

    def run(groups):
        policy.zero_grad()
        loss, logits = 0.0, {}
        for g in groups:
            out = _step(obj, policy, model, _batch(model, g), (7, 2), n_pairs=4)
            loss += out.loss.item()
            logits.update({UIDS[i]: v for i, v in zip(g, out.logits.tolist())})
        return loss, logits, _grads(policy)

    loss, logits, grads = run([[0, 1, 2, 3]])
    assert loss != pytest.approx(math.log(2), abs=1e-4)  # not the trivial point
    for groups in ([[2, 0, 3, 1]], [[0, 1], [2, 3]], [[3], [1, 0], [2]], [[0], [1], [2], [3]]):
        other_loss, other_logits, other_grads = run(groups)
        assert other_loss == pytest.approx(loss, abs=1e-6)
        for uid in UIDS:
            assert other_logits[uid] == pytest.approx(logits[uid], abs=1e-6)
        for name in grads:
            torch.testing.assert_close(other_grads[name], grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["vrpo", "elbo_dpo"])
def test_proxy_gradient_equals_the_full_graph_gradient(algorithm):
    model = make_tiny_llada().double()
    policy = _perturbed(model, scale=0.05)
    b = _batch(model)
    results = []
    for rows_per_forward in (4, 1, 3):  # one pass with the full graph; replay per row; uneven chunks
        obj = _objective(model, algorithm, mc_num=4, rows_per_forward=rows_per_forward)
        policy.zero_grad()
        out = _step(obj, policy, model, b, (5, 9))
        results.append((out.loss.item(), out.logits, _grads(policy)))
    (loss, logits, grads), *others = results
    for other_loss, other_logits, other_grads in others:
        assert other_loss == pytest.approx(loss, rel=1e-6)
        torch.testing.assert_close(other_logits, logits, rtol=1e-6, atol=1e-7)
        for name in grads:
            torch.testing.assert_close(other_grads[name], grads[name], rtol=1e-6, atol=1e-10)


# --------------------------------------------------------------------------- seeding


def _fingerprint(cs: CorruptionSet) -> list:
    return [(r.noisy_ids.clone(), r.scored.clone(), r.elbo_weight().clone()) for r in cs.rows]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) and len(a) == len(b)


@pytest.mark.parametrize("algorithm", ["vrpo", "elbo_dpo"])
def test_masks_come_from_seeds_not_from_the_global_rng(algorithm):
    model = make_tiny_llada()
    policy = _perturbed(model)
    obj = _objective(model, algorithm)
    b = _batch(model)
    torch.manual_seed(1)
    random.seed(1)
    state, py_state = torch.random.get_rng_state(), random.getstate()
    first = obj.corrupt(b, (0, 5))
    r = obj.reference_elbos(model, b, first)
    obj.update(policy, b, first, r, 4, lambda loss: loss.backward())
    assert torch.equal(torch.random.get_rng_state(), state) and random.getstate() == py_state
    torch.manual_seed(999)  # a different global state changes nothing
    again = obj.corrupt(b, (0, 5))
    assert _same(_fingerprint(first.policy), _fingerprint(again.policy))
    assert _same(_fingerprint(first.reference), _fingerprint(again.reference))
    assert not _same(_fingerprint(first.policy), _fingerprint(obj.corrupt(b, (0, 6)).policy))  # next step: fresh
    assert not _same(_fingerprint(first.policy), _fingerprint(obj.corrupt(b, (1, 5)).policy))  # other run seed
    assert first.shared == (algorithm == "vrpo")
    if not first.shared:
        assert not _same(_fingerprint(first.policy), _fingerprint(first.reference))
    # a pair's masks do not depend on its batch neighbours or its position
    alone = obj.corrupt(_batch(model, [2]), (0, 5)).policy
    for row_all, row_alone in zip(first.policy.rows, alone.rows):
        for k, (a, c) in enumerate(zip(row_all.scored[4:6], row_alone.scored)):
            assert torch.equal(a[-PAD_TO:], c[-PAD_TO:]), k
    # chosen and rejected draw independent masks, even for identical responses
    same = obj.corrupt(_batch(model, rejected=CHOSEN), (0, 5)).policy
    assert any(not torch.equal(r.scored[0], r.scored[1]) for r in same.rows)
    shared_pair = obj.corrupt(_batch(model, rejected=CHOSEN), (0, 5), share_pair=True).policy
    assert all(torch.equal(r.scored[0], r.scored[1]) for r in shared_pair.rows)


@pytest.mark.parametrize("algorithm, shared", [("vrpo", True), ("elbo_dpo", False)])
def test_reference_and_policy_see_bitwise_equal_inputs_only_under_shared_masks(algorithm, shared):
    model = make_tiny_llada()
    obj = _objective(model, algorithm)
    b = _batch(model)
    seen = {"ref": set(), "policy": set()}
    original = model.stream_hidden  # every scoring forward runs its token stream through it

    def recording(key):
        def stream_hidden(stream, *args, **kwargs):
            for row in stream.ids:
                seen[key].add(hashlib.sha256(row.numpy().tobytes()).hexdigest())
            return original(stream, *args, **kwargs)
        return stream_hidden

    corr = obj.corrupt(b, (3, 4))
    model.stream_hidden = recording("ref")
    r = obj.reference_elbos(model, b, corr)
    model.stream_hidden = recording("policy")
    obj.update(model, b, corr, r, 4, lambda loss: loss.backward())
    assert seen["ref"] and seen["policy"]  # both scored through the recorded forward
    assert (seen["ref"] == seen["policy"]) is shared
    if not shared:
        assert len(seen["ref"] & seen["policy"]) < len(seen["ref"])
