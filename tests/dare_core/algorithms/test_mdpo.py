"""MDPO: step scores by hand, step selection, the scored set, and the reduction to token PPO."""
import pytest
import torch

from algo_helpers import make_algo, run_update
from conftest import make_tiny_llada
from dare_core.algorithms.common import token_policy_loss
from dare_core.algorithms.mdpo import select_steps, step_advantages, step_scores
from dare_core.batch import Batch
from dare_core.config import RLConfig
from dare_core.sampling.params import SamplingParams

EOS, MASK = 38, 39


def test_step_scores_by_hand():
    r = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.5]])
    # sigma_t = (r_t - r_{t-1}) + 1 + mean_{t'>t} r_t' ; sigma_K = (r_K - r_{K-1}) + 1 + r_K
    want = torch.tensor([[0 + 1 + 1.0, 1 + 1 + 1.0, 0 + 1 + 1.0],
                         [1 + 1 + 0.25, -1 + 1 + 0.5, 0.5 + 1 + 0.5]])
    torch.testing.assert_close(step_scores(r), want)


def test_step_advantages_per_step_and_selection():
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])  # two groups of 2
    adv = step_advantages(r, group_size=2, estimator="grpo_no_std")
    sig = step_scores(r)
    torch.testing.assert_close(adv[:2], sig[:2] - sig[:2].mean(0))
    assert torch.equal(adv[2:], torch.zeros(2, 2))  # identical rewards: no signal
    a = torch.tensor([[0.1, -2.0, 0.3, 0.0], [0.1, 1.0, -0.9, 0.0]])
    assert select_steps(a, 2).tolist() == [1, 2]  # largest sum |A_t|, returned in step order


def _batch(n=4, P=3, L=5, K=3, seed=0):
    """A hand-built cache-free rollout record: steps 1..K commit positions, x0_hat proposals."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30, (n, P + L), generator=g)
    attn = torch.ones_like(ids)
    step_map = torch.tensor([[1, 1, 2, 3, 3]] * n, dtype=torch.int32)
    decoded = ids[:, P:].clone()
    x0 = torch.randint(0, 30, (n, K, L), generator=g).int()
    x0[:, 1, :2] = -1  # a proposal that was not recorded is never scored
    conf = torch.rand(n, K, L, generator=g)
    valid = torch.ones(n, L, dtype=torch.bool)
    return Batch(ids, attn, P, valid, [f"u{i}" for i in range(n)], torch.zeros(n),
                 {"step_map": step_map, "decoded": decoded, "x0_hat": x0, "confidence": conf})


class FixedRewards:
    """A rollout context whose reward is the fraction of tokens equal to 7 (deterministic)."""

    def rewards(self, index, responses):
        return (responses == 7).float().mean(-1)


def test_scored_positions_are_masked_in_the_state():
    model = make_tiny_llada()
    algo = make_algo("mdpo", model, RLConfig(group_size=2, sampler=SamplingParams(gen_length=5, steps=3, block_length=5, temperature=1.0)),
                     sample_train_steps=3)
    batch = _batch()
    z, x0_t, scored = algo._states(batch)
    assert not (scored & (z != MASK)).any()  # only positions still masked in z_t
    assert not scored[:, 1, :2].any()  # committed at step 1: known in z_2
    assert torch.equal(x0_t[:, 0], batch.records["x0_hat"][:, 0].long())  # step 1: everything proposed
    algo.prepare(batch, FixedRewards())
    c = algo.corrupt(batch, (0, 0, 0))
    for row, t in zip(c.rows, batch.records["steps_chosen"][0].tolist()):
        assert torch.equal(row.scored[:, batch.prompt_len:], scored[:, t].to(row.scored.device))
        assert torch.equal(row.noisy_ids[:, batch.prompt_len:], z[:, t])


def test_reduces_to_token_ppo_with_unit_confidence_and_lambda():
    model = make_tiny_llada()
    rl = RLConfig(group_size=2, clip_eps_low=0.2, clip_eps_high=0.2, sampler=SamplingParams(gen_length=5, steps=3, block_length=5, temperature=1.0))
    algo = make_algo("mdpo", model, rl, sample_train_steps=1)
    batch = _batch()
    batch.records["confidence"][:] = 1.0
    batch.records["step_adv"] = torch.tensor([[0.5], [-1.0], [1.5], [0.2]])
    batch.records["steps_chosen"] = torch.zeros(4, 1, dtype=torch.long)  # step 1: all 5 positions masked, lambda = 5/5
    c = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        old = algo.score(model, batch, c) - 0.2 * torch.stack([r.scored for r in c.rows], 1).float()
    out = run_update(algo, model, batch, c, old, None, backward=False)
    s = algo.score(model, batch, c)[:, 0]
    mask = c.rows[0].scored.float()
    want, _ = token_policy_loss(s, old[:, 0], None, batch.records["step_adv"], mask, float(mask.sum()), rl)
    torch.testing.assert_close(out.loss, want.detach(), atol=1e-6, rtol=1e-5)


def test_real_rollout_runs_one_update():
    from dare_core.sampling.decode import generate

    model = make_tiny_llada()
    params = SamplingParams(gen_length=6, steps=3, block_length=6, temperature=1.0)
    rl = RLConfig(group_size=2, sampler=params)
    algo = make_algo("mdpo", model, rl, sample_train_steps=2)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = generate(model, [[1, 2, 3], [4, 5], [1, 2, 3], [4, 5]], params, gens, record="full")
    resp = out.response
    from dare_core.diffusion.masking import valid_region

    batch = Batch(out.sequences, out.attention_mask, out.prompt_len, valid_region(resp, model.eos_token_id), ["a", "b", "c", "d"],
                  torch.zeros(4), {"step_map": out.step_map, "decoded": out.trajectory.response_tokens(6),
                                   "x0_hat": out.trajectory.x0_hat, "confidence": out.trajectory.confidence})
    algo.prepare(batch, FixedRewards())
    c = algo.corrupt(batch, (0, 0, 0))
    model.zero_grad()
    res = run_update(algo, model, batch, c)
    assert torch.isfinite(res.loss)


def test_loss_by_hand_with_step_weights_and_confidences():
    """Two selected steps with different masked counts (lambda_t = L / |M_t| = 5/5 and 5/3), random
    confidences, old != current, the ratio clipped for some tokens: the loss written out token by token
    from the records, independently of the algorithm's code."""
    model = make_tiny_llada()
    rl = RLConfig(group_size=2, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0,
                  sampler=SamplingParams(gen_length=5, steps=3, block_length=5, temperature=1.0))
    algo = make_algo("mdpo", model, rl, sample_train_steps=2)
    batch = _batch()
    P, L = batch.prompt_len, 5
    batch.records["step_adv"] = torch.tensor([[0.5, -1.2], [-1.0, 0.7], [1.5, -0.3], [0.2, 2.0]])
    batch.records["steps_chosen"] = torch.tensor([[0, 1]] * 4)  # steps 1 and 2
    c = algo.corrupt(batch, (0, 0, 0))
    shift = torch.tensor([0.5, -0.4, 0.05, -0.6, 0.3])  # per position: some ratios leave [0.8, 1.2]
    with torch.no_grad():
        old = algo.score(model, batch, c).clone()
        old[..., P:] += shift
    out = run_update(algo, model, batch, c, old, None, backward=False)

    steps, decoded = batch.records["step_map"].long(), batch.records["decoded"].long()
    x0, conf = batch.records["x0_hat"].long(), batch.records["confidence"].double()
    total, ratios = 0.0, []
    for j, t in enumerate((1, 2)):  # step t: positions committed at steps < t are known
        step_loss, count = 0.0, 0
        state = batch.input_ids.clone()
        for b in range(len(batch)):
            for i in range(L):
                if not 0 < steps[b, i] < t:
                    state[b, P + i] = MASK
        with torch.no_grad():
            logp = torch.log_softmax(model(state, batch.attention_mask).double(), -1)
        n_masked = int((state[0, P:] == MASK).sum())  # the same pattern in every row here
        lam = L / n_masked
        for b in range(len(batch)):
            a = float(batch.records["step_adv"][b, j])
            for i in range(L):
                if state[b, P + i] != MASK or x0[b, t - 1, i] < 0:
                    continue
                s = logp[b, P + i, x0[b, t - 1, i]]
                r = float(torch.exp(s - old[b, j, P + i].double()))
                ratios.append(r)
                lc = max(-a * r, -a * min(max(r, 0.8), 1.2))
                if a < 0:
                    lc = min(lc, -a * 3.0)
                step_loss += lam * lc * float(conf[b, t - 1, i])
                count += 1
        total += step_loss / count
    assert n_masked == 3  # the second step is weighted 5/3, not 1
    torch.testing.assert_close(out.loss.double(), torch.tensor(total / 2, dtype=torch.float64), atol=1e-6, rtol=1e-5)
    # the largest ratio of any scored token of any step, not a mean over the steps
    assert out.metrics["ratio_max"] == pytest.approx(max(ratios), rel=1e-5)


def test_an_edited_rollouts_states_hold_its_edits():
    """Token editing: z_t is the sampler's state before step t, earlier edits applied (a state built
    from the step map alone would show final tokens instead); the scored positions are those still
    masked in it; an update runs."""
    from dare_core.algorithms.rollout import _records
    from dare_core.diffusion.masking import valid_region
    from dare_core.sampling.decode import generate

    model = make_tiny_llada()
    params = SamplingParams(gen_length=6, steps=6, block_length=3, temperature=1.0, remasking="maskgit_plus",
                            unmasking="threshold", threshold=0.5, edit_threshold=0.0, post_edit_steps=2)
    algo = make_algo("mdpo", model, RLConfig(group_size=2, sampler=params), sample_train_steps=3)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = generate(model, [[1, 2, 3], [4, 5], [1, 2, 3], [4, 5]], params, gens, record="full")
    records = _records([out], algo.requires)
    assert "edit_steps" in records and (records["edit_steps"] > 0).any()
    batch = Batch(out.sequences, out.attention_mask, out.prompt_len, valid_region(out.response, model.eos_token_id),
                  ["a", "b", "c", "d"], torch.zeros(4), records)
    z, _, scored = algo._states(batch)
    for b in range(4):
        for t, state in enumerate(out.trajectory.states(b)):
            assert torch.equal(z[b, t], state), (b, t)
    assert not (scored & (z != MASK)).any()
    stale = 0
    for t in range(z.shape[1]):  # the edits show: some state differs from the final tokens where both are known
        known = z[:, t] != MASK
        stale += int((z[:, t][known] != records["decoded"].long()[known]).sum())
    assert stale > 0
    algo.prepare(batch, FixedRewards())
    model.zero_grad()
    assert torch.isfinite(run_update(algo, model, batch, algo.corrupt(batch, (0, 0, 0))).loss)
