"""d-TreeRPO (docs/algorithms.md#d-tree-rpo): the tree, its values and leave-one-out advantages, the active sets
of the transitions, the self-distillation schedule, the loss by hand, where gradients come from,
and a non-trivial ratio on the second inner update."""
import copy
import math

import pytest
import torch

from algo_helpers import make_algo, run_update
from conftest import make_tiny_llada
from dare_core.algorithms.d_tree_rpo import (
    active_set,
    local_advantages,
    node_values,
    sd_lambda,
    sd_tau,
)
from dare_core.algorithms.rollout import RolloutSpec
from dare_core.config import DareConfig, RLConfig, SamplerConfig
from dare_core.rewards.base import RewardResult
from dare_core.rewards.registry import REWARDS
from dare_core.sampling.decode import generate
from dare_core.sampling.engines import build_engine
from dare_core.sampling.tree import TreeOutput, branch_points, tree_rollout, tree_shape

EOS, MASK = 38, 39
PROMPTS = [[1, 2, 3, 4, 5], [6, 7]]


def _rl(group_size, steps=8, **kw):
    sampler = SamplerConfig(gen_length=8, steps=steps, block_length=8, temperature=1.0, stop_at_eos=False, batch_size=7)
    return RLConfig(group_size=group_size, sampler=sampler, **kw)


def _algo(model, group_size=4, rl=None, **opts):
    opts = {"num_tree_samples": 2, "branch_factor": 2, **opts}
    return make_algo("d_tree_rpo", model, rl or _rl(group_size), **opts)


# --------------------------------------------------------------------------- tree shape


def test_tree_shape_128_2_4_4():
    shape = tree_shape(128, 2, 4, 4)
    assert list(shape.branch_points) == [128, 64, 0]
    assert shape.segments == [(0, 64), (64, 128)]
    assert len(shape.leaves) == 16 and len(shape.transitions) == 20 and shape.num_nodes == 21
    assert shape.children(0) == [1, 2, 3, 4]
    for n in (1, 2, 3, 4):
        kids = shape.children(n)
        assert len(kids) == 4 and all(shape.parent[k] == n and k in shape.leaves for k in kids)
    assert [shape.level.count(d) for d in range(3)] == [1, 4, 16]


def test_branch_points_deduplicate_and_descend():
    assert branch_points(8, 2) == [8, 4, 0]
    assert branch_points(6, 4) == [6, 5, 3, 2, 0]
    assert branch_points(2, 4) == [2, 1, 0]  # floor(kT/s) repeats: de-duplicated
    assert branch_points(5, 1) == [5, 0]
    three = tree_shape(9, 3, 2, 3)  # [9, 6, 3, 0]: 2 + 6 + 18 nodes below the root
    assert len(three.leaves) == 18 and len(three.transitions) == 26 and three.depth == 3


# --------------------------------------------------------------------------- values and advantages


def test_node_values_and_leave_one_out_advantages_by_hand():
    shape = tree_shape(4, 2, 3, 2)  # root -> 1, 2, 3; 1 -> 4, 5; 2 -> 6, 7; 3 -> 8, 9
    assert shape.children(0) == [1, 2, 3] and shape.children(1) == [4, 5] and shape.leaves == [4, 5, 6, 7, 8, 9]
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0, 0.5], [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]])
    v = node_values(shape, rewards)
    torch.testing.assert_close(v[0, [1, 2, 3]], torch.tensor([0.5, 1.0, 0.25]))
    torch.testing.assert_close(v[0, 0], torch.tensor((0.5 + 1.0 + 0.25) / 3))
    a = local_advantages(shape, v)
    # leaves against their one sibling, level-1 nodes against the mean of the other two
    torch.testing.assert_close(a[0, 4:], torch.tensor([1.0, -1.0, 0.0, 0.0, -0.5, 0.5]))
    torch.testing.assert_close(a[0, 1:4], torch.tensor([0.5 - 0.625, 1.0 - 0.375, 0.25 - 0.75]))
    assert a[0, 0] == 0
    assert (a[1] == 0).all()  # identical rewards: no advantage anywhere
    # an only child has no sibling baseline
    lone = tree_shape(4, 2, 2, 1)
    a1 = local_advantages(lone, node_values(lone, torch.tensor([[1.0, 0.0]])))
    torch.testing.assert_close(a1[0], torch.tensor([0.0, 1.0, -1.0, 0.0, 0.0]))


# --------------------------------------------------------------------------- rollout


def test_tree_rollout_on_a_tiny_model():
    model = make_tiny_llada()
    params = SamplerConfig(gen_length=8, steps=8, block_length=8, temperature=1.0, stop_at_eos=False)
    shape = tree_shape(8, 2, 3, 2)
    tree = tree_rollout(model, PROMPTS, params, shape, (0, "tree", 0), ["p0", "p1"], batch_size=4)
    assert tree.states.shape == (2, shape.num_nodes, 8) and tree.responses.shape == (2, 6, 8)
    assert (tree.states[:, 0] == MASK).all()
    decoded = (tree.states != MASK).sum(-1)
    for n in range(shape.num_nodes):  # one token per step: 4 after the first segment, 8 at the leaves
        assert (decoded[:, n] == 4 * shape.level[n]).all()
    for n in shape.transitions:  # a child keeps every token its parent had
        p = tree.states[:, shape.parent[n]]
        assert torch.equal(tree.states[:, n][p != MASK], p[p != MASK])
    assert torch.equal(tree.responses, tree.states[:, shape.leaves])
    assert (tree.steps == 8).all()
    # siblings draw from their own generators: the three children of a root differ
    for b in range(2):
        kids = tree.states[b, shape.children(0)]
        assert len({tuple(k.tolist()) for k in kids}) == 3
    # reproducible from the seeds, whatever the chunking
    again = tree_rollout(model, PROMPTS, params, shape, (0, "tree", 0), ["p0", "p1"], batch_size=100)
    assert torch.equal(again.states, tree.states)


def test_greedy_tree_paths_equal_one_uninterrupted_run():
    model = make_tiny_llada()
    params = SamplerConfig(gen_length=8, steps=8, block_length=4, temperature=0.0, stop_at_eos=False)
    shape = tree_shape(8, 4, 2, 2)  # [8, 6, 4, 2, 0]: splits inside and at the end of blocks
    tree = tree_rollout(model, PROMPTS, params, shape, (0, "tree", 0), ["p0", "p1"], batch_size=8)
    whole = generate(model, PROMPTS, params)
    for i in range(len(shape.leaves)):
        assert torch.equal(tree.responses[:, i], whole.response)


class _Tokenizer:
    eos_token_id = EOS

    def encode(self, text):
        return [1 + (ord(c) % 30) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _even_share(text, ground_truth, extra=None):
    ids = [int(t) for t in text.split()] if text else []
    score = sum(1 for t in ids if t % 2 == 0) / 8
    return RewardResult(score, float(score > 0.5), None)


REWARDS.setdefault("test_tree_even_share", _even_share)


def test_rollout_builds_one_row_per_transition():
    model = make_tiny_llada()
    rl = _rl(group_size=4, reward="test_tree_even_share", num_steps=10)
    cfg = DareConfig(rl=rl)
    algo = _algo(model, rl=rl)
    rows = [{"uid": "a", "prompt_text": "12+3=", "ground_truth": "15"}, {"uid": "b", "prompt_text": "7*2=", "ground_truth": "14"}]
    batch, metrics = algo.rollout(build_engine("native", model), _Tokenizer(), rows, RolloutSpec.of(rl, cfg.run.seed, 5))
    assert algo.rows_per_prompt == 6 and len(batch) == 12
    for key in ("reward", "accuracy", "zero_std_ratio", "active_tokens", "rollout_nfe"):
        assert math.isfinite(metrics[key])
    P = batch.prompt_len
    parent, child = batch.records["parent_state"], batch.input_ids[:, P:]
    assert torch.equal(batch.response_mask, (parent == MASK) & (child != MASK))
    assert (batch.response_mask.sum(-1) == 4).all()  # 8 steps, 2 segments, one token per step
    c = algo.corrupt(batch, (0, 5, 0))
    assert torch.equal(c.noisy_ids[:, P:], parent) and torch.equal(c.noisy_ids[:, :P], batch.input_ids[:, :P])
    assert torch.equal(c.scored[:, P:], batch.response_mask) and not c.scored[:, :P].any()
    # the rows of a prompt: its 6 transitions, advantages summing to 0 among siblings
    assert batch.records["node"].tolist() == [1, 2, 3, 4, 5, 6] * 2
    adv = batch.advantages.view(2, 6)
    torch.testing.assert_close(adv[:, :2].sum(-1), torch.zeros(2))
    assert metrics["sd_lambda"] == pytest.approx(sd_lambda(0.5, 3e-3, 2.0))
    out = run_update(algo, model, batch, c)
    assert math.isfinite(float(out.loss))


# --------------------------------------------------------------------------- the active set


def test_active_set_is_parent_mask_and_child_decoded():
    parent = torch.tensor([[MASK, 5, MASK, MASK, 7]])
    child = torch.tensor([[3, 5, MASK, 9, 7]])
    assert active_set(parent, child, MASK).tolist() == [[True, False, False, True, False]]
    # a child token that happens to be the mask id is never active; a decoded parent position never is
    assert not active_set(torch.tensor([[4]]), torch.tensor([[6]]), MASK).any()


# --------------------------------------------------------------------------- self-distillation schedule


def test_schedules():
    assert sd_lambda(0.0, 3e-3, 2.0) == 0.0
    assert sd_lambda(1.0, 3e-3, 2.0) == pytest.approx(3e-3)
    assert 0 < sd_lambda(0.5, 3e-3, 2.0) < 1.5e-3  # convex: below the linear ramp
    assert sd_lambda(0.5, 3e-3, 0.0) == pytest.approx(1.5e-3)
    assert sd_tau(0.0, 2.0, 0.7) == pytest.approx(2.0)
    assert sd_tau(1.0, 2.0, 0.7) == 1e-6
    assert sd_tau(0.5, 2.0, 0.7) == pytest.approx(2.0 * 0.5 ** 0.7)


# --------------------------------------------------------------------------- loss by hand


def _hand_tree():
    """Two prompts with the same hand-written tree (T=4, s=2, n_tree=3, bf=2) over L = 4."""
    shape = tree_shape(4, 2, 3, 2)
    M = MASK
    level1 = [[5, M, M, M], [M, 6, M, M], [5, M, M, M]]
    leaves = [[[5, 1, 2, 3], [5, 1, 4, 3]], [[8, 6, M, 2], [8, 6, 9, 9]], [[5, 2, 2, 2], [5, 7, 1, 1]]]
    states = torch.full((shape.num_nodes, 4), M)
    for i, n in enumerate(shape.children(0)):
        states[n] = torch.tensor(level1[i])
        for k, leaf in zip(shape.children(n), leaves[i]):
            states[k] = torch.tensor(leaf)
    states = states.expand(2, -1, -1).clone()
    return shape, TreeOutput(shape, states, states[:, shape.leaves], 0, torch.zeros(2, 6))


def _hand_batch(algo, progress=0.6):
    shape, tree = _hand_tree()
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.25, 0.75]])
    batch, info = algo.transition_batch(tree, [[1, 2, 3], [4, 5]], ["u0", "u1"], rewards, progress, pad_id=EOS)
    return shape, tree, rewards, batch, info


def _slow_loss(model, shape, tree, rewards, prompts, old, ref, rl, progress, lam_max=3e-3, gamma=2.0, tau_max=2.0, beta_sd=0.7):
    """The loss of 5.8 written out transition by transition (float64)."""
    B, N, L = tree.states.shape
    width = max(len(p) for p in prompts)
    # values and advantages
    V = {}
    for b in range(B):
        for i, leaf in enumerate(shape.leaves):
            V[b, leaf] = float(rewards[b, i])
        for n in reversed(range(N)):
            kids = [k for k in range(N) if shape.parent[k] == n]
            if kids:
                V[b, n] = sum(V[b, k] for k in kids) / len(kids)
    A = {}
    for b in range(B):
        for n in range(1, N):
            sib = [m for m in range(1, N) if shape.parent[m] == shape.parent[n] and m != n]
            A[b, n] = V[b, n] - sum(V[b, m] for m in sib) / len(sib)

    def forward(b, node):
        ids = [EOS] * (width - len(prompts[b])) + prompts[b] + tree.states[b, node].tolist()
        attn = [0] * (width - len(prompts[b])) + [1] * (len(prompts[b]) + L)
        logits = model(torch.tensor([ids]), torch.tensor([attn]))[0].double()
        return torch.log_softmax(logits, -1)

    total, count, row = 0.0, 0, 0
    for b in range(B):
        for n in range(1, N):
            p = shape.parent[n]
            logp = forward(b, p)
            terms = []
            for j in range(L):
                if tree.states[b, p, j] == MASK and tree.states[b, n, j] != MASK:
                    col = width + j
                    s = logp[col, tree.states[b, n, j]]
                    r = torch.exp(s - old[row, col].double())
                    a = A[b, n]
                    clip = min(max(r, 1 - rl.clip_eps_low), 1 + rl.clip_eps_high)
                    term = -min(r * a, clip * a)
                    d = s - ref[row, col].double()
                    term = term + rl.kl_beta * min(torch.exp(-d) + d - 1, 10.0)
                    terms.append(term)
            if terms:
                total += sum(terms) / len(terms)
                count += 1
            row += 1
    loss = total / count
    # self-distillation
    lam = lam_max * (math.exp(gamma * progress) - 1) / (math.exp(gamma) - 1)
    tau = max(tau_max * (1 - progress) ** beta_sd, 1e-6)
    kls = []
    for b in range(B):
        for p in range(N):
            kids = [k for k in range(N) if shape.parent[k] == p]
            pos = [k for k in kids if A[b, k] > 0]
            if not pos:
                continue
            z = sum(math.exp(A[b, k] / tau) for k in pos)
            w = {k: math.exp(A[b, k] / tau) / z for k in pos}
            logp = forward(b, p)
            for j in range(L):
                if tree.states[b, p, j] != MASK:
                    continue
                q = {}
                for k in pos:
                    t = int(tree.states[b, k, j])
                    if t != MASK:
                        q[t] = q.get(t, 0.0) + w[k]
                if not q:
                    continue
                zq = sum(q.values())
                kls.append(sum(v / zq * (math.log(v / zq) - logp[width + j, t]) for t, v in q.items()))
    if kls:
        loss = loss + lam * sum(kls) / len(kls)
    return loss, len(kls)


@pytest.mark.parametrize("micro", [None, 1, 5])
def test_loss_equals_slow_implementation(micro):
    model = make_tiny_llada()
    rl = _rl(group_size=6, steps=4, kl_beta=0.05, clip_eps_low=0.2, clip_eps_high=0.3)
    algo = make_algo("d_tree_rpo", model, rl, num_tree_samples=3, branch_factor=2)
    shape, tree, rewards, batch, info = _hand_batch(algo, progress=0.6)
    assert info["sd_pairs"] > 0
    c = algo.corrupt(batch, (0, 0, 0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        s = algo.score(model, batch, c)
        old = s - 0.4 * torch.rand(s.shape, generator=g) * c.scored  # pi_old differs: clipping bites
        ref = s + 0.3 * torch.randn(s.shape, generator=g) * c.scored
    with torch.no_grad():
        expected, pairs = _slow_loss(model, shape, tree, rewards, [[1, 2, 3], [4, 5]], old, ref, rl, 0.6)
    denom = algo.denominator(batch, c)
    assert denom.tolist() == [float((c.scored.any(-1)).sum()), float(pairs)]
    if micro is None:
        loss = float(run_update(algo, model, batch, c, old, ref, denom, backward=False).loss)
    else:
        loss = 0.0
        for idx in torch.arange(len(batch)).split(micro):
            loss += float(run_update(algo, model, batch.select(idx), c.select(idx), old[idx], ref[idx], denom, backward=False).loss)
    assert loss == pytest.approx(float(expected), abs=1e-5, rel=1e-5)


def test_gradient_independent_of_micro_batch_split():
    model = make_tiny_llada()
    algo = make_algo("d_tree_rpo", model, _rl(group_size=6, steps=4, kl_beta=0.05), num_tree_samples=3, branch_factor=2)
    _, _, _, batch, _ = _hand_batch(algo)
    c = algo.corrupt(batch, (0, 0, 0))
    denom = algo.denominator(batch, c)
    run_update(algo, model, batch, c, None, c.scored.float() * -0.1, denom)
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for idx in torch.arange(len(batch)).split(4):
        run_update(algo, model, batch.select(idx), c.select(idx), None, (c.scored.float() * -0.1)[idx], denom)
    for a, b in zip(whole, model.parameters()):
        torch.testing.assert_close(a, b.grad, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- where gradients come from


def test_gradients_only_from_active_positions_and_advantages():
    model = make_tiny_llada()
    algo = make_algo("d_tree_rpo", model, _rl(group_size=6, steps=4), num_tree_samples=3, branch_factor=2, self_distill=False)
    _, _, _, batch, _ = _hand_batch(algo)
    c = algo.corrupt(batch, (0, 0, 0))
    P = batch.prompt_len
    # a transition whose advantage is zero contributes no gradient
    only = batch.select(torch.tensor([2]))
    only.advantages[:] = 0
    run_update(algo, model, only, c.select(torch.tensor([2])), None, None, 1.0)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    # the loss and gradient do not see the child's tokens, nor old / ref scores, off the active set
    model.zero_grad()
    with torch.no_grad():
        old = algo.score(model, batch, c) - 0.2 * c.scored
    base = run_update(algo, model, batch, c, old, None)
    g_base = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    b2 = copy.deepcopy(batch)
    inactive = ~c.scored[:, P:] & (batch.records["parent_state"] != MASK)  # decoded before the transition
    assert inactive.any()
    b2.input_ids[:, P:][inactive] = (b2.input_ids[:, P:][inactive] + 7) % 30
    b2.input_ids[:, :P] = torch.where(b2.attention_mask[:, :P].bool(), b2.input_ids[:, :P], 0)  # padding ids
    old2 = old.clone()
    old2[~c.scored] = 123.0
    c2 = algo.corrupt(b2, (0, 0, 0))
    assert torch.equal(c2.scored, c.scored)
    out = run_update(algo, model, b2, c2, old2, None)
    assert float(out.loss) == pytest.approx(float(base.loss), abs=1e-7)
    for a, p in zip(g_base, model.parameters()):
        torch.testing.assert_close(a, p.grad)
    # scores exist exactly on the active set (never the prompt)
    s = algo.score(model, batch, c)
    assert (s[~c.scored] == 0).all() and (s[c.scored] < 0).all()


def test_ratio_is_one_first_update_and_not_second():
    model = make_tiny_llada()
    model.train()
    rl = _rl(group_size=6, steps=4, clip_eps_low=0.2, clip_eps_high=0.2)
    algo = make_algo("d_tree_rpo", model, rl, num_tree_samples=3, branch_factor=2)
    _, _, _, batch, _ = _hand_batch(algo)
    corr = [algo.corrupt(batch, (0, 0, it)) for it in range(2)]
    with torch.no_grad():
        old = [algo.score(model, batch, c) for c in corr]
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ratios = []
    for it in range(2):
        opt.zero_grad()
        out = run_update(algo, model, batch, corr[it], old[it], None)
        ratios.append((out.metrics["ratio"], out.metrics["clipfrac_hi"] + out.metrics["clipfrac_lo"]))
        opt.step()
    assert abs(ratios[0][0] - 1.0) < 1e-6 and ratios[0][1] == 0.0
    assert abs(ratios[1][0] - 1.0) > 1e-3 and ratios[1][1] > 0.0


# --------------------------------------------------------------------------- configuration


def test_configuration_errors():
    model = make_tiny_llada()
    with pytest.raises(ValueError, match="rl.group_size must equal the leaves per prompt .*: 16"):
        make_algo("d_tree_rpo", model, _rl(group_size=8), num_tree_samples=4)
    assert make_algo("d_tree_rpo", model, _rl(group_size=16)).rows_per_prompt == 20
    # num_tree_samples unset: the group is the leaves (8 = 2 roots x 4^1; 16 = 4 x 4^1)
    assert make_algo("d_tree_rpo", model, _rl(group_size=8)).options.num_tree_samples == 2
    assert make_algo("d_tree_rpo", model, _rl(group_size=16)).options.num_tree_samples == 4
    with pytest.raises(ValueError, match="not a whole number of root subtrees of 4 leaves"):
        make_algo("d_tree_rpo", model, _rl(group_size=6))
    bad = _rl(group_size=16)
    bad.sampler = SamplerConfig(gen_length=8, steps=8, block_length=8, cache="dual")
    with pytest.raises(ValueError, match="cache: none"):
        make_algo("d_tree_rpo", model, bad)
    with pytest.raises(ValueError, match="num_tree_samples >= 2"):
        _algo(model, num_tree_samples=1)
    sdar = pytest.importorskip("tiny_models").tiny("sdar")
    with pytest.raises(ValueError, match="not defined for block-diffusion"):
        make_algo("d_tree_rpo", sdar, _rl(group_size=16))


def test_rl_config_check_counts_transitions():
    from dare_core.training.rl.checks import check_rl_config

    cfg = DareConfig(rl=_rl(group_size=16, prompts_per_step=4, micro_batch_size=32))
    check_rl_config(cfg)  # 64 rollouts: fine for group-size algorithms
    with pytest.raises(ValueError, match="micro_batch_size = 32 must divide the mini-batch size 80"):
        check_rl_config(cfg, 20)
    cfg.rl.micro_batch_size = 40
    check_rl_config(cfg, 20)


@pytest.mark.parametrize("family", ["llada", "Dream"])
def test_tree_update_on_both_masked_families(family):
    """A real tree of a shifted (Dream) and an unshifted (LLaDA) model: the update's one forward
    scores what `score` scores (ratio 1 against it), with a finite loss and gradient."""
    from tiny_models import tiny

    model = tiny(family)
    rl = _rl(group_size=4, kl_beta=0.02)
    algo = _algo(model, rl=rl)
    tree = tree_rollout(model, PROMPTS, rl.sampler, algo.shape, (1, "tree", 0), ["p0", "p1"], batch_size=8)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.0, 1.0, 1.0]])
    batch, info = algo.transition_batch(tree, PROMPTS, ["p0", "p1"], rewards, 0.7, model.pad_token_id)
    assert info["sd_pairs"] > 0
    c = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        old = algo.score(model, batch, c)
    out = run_update(algo, model, batch, c, old, old + 0.1 * c.scored)
    assert out.metrics["ratio"] == pytest.approx(1.0, abs=1e-6) and math.isfinite(float(out.loss))
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert torch.isfinite(g).all() and g.abs().sum() > 0
