"""Coupled-GRPO (docs/diffusion.md#coupled-passes, docs/algorithms.md#coupled-grpo): the three-pass score and the token PPO loss by hand, fresh
(t, u) per sample and iteration, the pure A/B pair as an option."""
import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.batch import Batch
from dare_core.config import RLConfig
from dare_core.diffusion.masking import valid_region
from rl_reference import kl, plain_logp, ppo
from tiny_models import tiny

EOS, MASK = 62, 63


def _batch(n=5, P=4, L=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (n, P + L), generator=g)
    ids[1, P + 3:] = EOS
    attn = torch.ones_like(ids)
    attn[0, :2] = 0
    valid = valid_region(ids[:, P:], EOS)
    return Batch(ids, attn, P, valid, [f"c{i}" for i in range(n)], torch.linspace(-1.0, 1.2, n))


@pytest.mark.parametrize("family,include_full", [("llada", True), ("Dream", True), ("llada", False)])
def test_loss_by_hand(family, include_full):
    model = tiny(family)
    rl = RLConfig(clip_eps_low=0.2, clip_eps_high=0.3, dual_clip=3.0, kl_beta=0.05, kl_estimator="k3")
    algo = make_algo("coupled_grpo", model, rl, include_full=include_full)
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    assert len(cs) == (3 if include_full else 2)
    with torch.no_grad():
        s0 = algo.score(model, batch, cs)
    old = s0 - 0.4 * cs.scored.float() * torch.linspace(-1, 1, s0.shape[1])
    ref = s0 + 0.2 * cs.scored.float()
    out = run_update(algo, model, batch, cs, old, ref, backward=False)
    # by hand: s_i = 1/2 [F + 1[A]/t A + 1[B]/(1-t) B]
    t = cs.info["t"].double()
    lp = [plain_logp(model, r.noisy_ids, batch.input_ids, batch.attention_mask) for r in cs.rows]
    a_set, b_set = cs.rows[0].scored, cs.rows[1].scored
    P = batch.prompt_len
    total, count = 0.0, 0
    for b in range(len(batch)):
        for i in range(P, batch.input_ids.shape[1]):
            if not batch.response_mask[b, i - P]:
                assert not cs.scored[b, i]
                continue
            assert bool(a_set[b, i]) != bool(b_set[b, i])
            pair = lp[0][b, i] / t[b] if a_set[b, i] else lp[1][b, i] / (1 - t[b])
            s = 0.5 * ((lp[2][b, i] if include_full else 0.0) + pair)
            r = torch.exp(s - old[b, i].double()).item()
            total += ppo(r, batch.advantages[b].item(), 0.2, 0.3, 3.0) + 0.05 * kl((s - ref[b, i].double()).item(), "k3")
            count += 1
    assert count == int(batch.response_mask.sum()) == int(algo.denominator(batch, cs)[0])
    assert float(out.loss) == pytest.approx(total / count, rel=1e-4, abs=1e-6)


def test_fresh_coupling_per_sample_and_iteration():
    model = tiny("llada")
    algo = make_algo("coupled_grpo", model)
    batch = _batch()
    t = torch.stack([algo.corrupt(batch, (0, step, it)).info["t"] for step in range(3) for it in range(2)])
    assert len(set(t.flatten().tolist())) == t.numel()
    assert ((t >= 0.2) & (t <= 0.8)).all()
    one, two = algo.corrupt(batch, (0, 0, 0)), algo.corrupt(batch, (0, 0, 0))
    for a, b in zip(one.rows, two.rows):
        assert torch.equal(a.noisy_ids, b.noisy_ids)
    # the partition through the algorithm: every valid token in exactly one of A, B; F all of V
    P = batch.prompt_len
    assert torch.equal(one.rows[0].scored[:, P:] ^ one.rows[1].scored[:, P:], batch.response_mask)
    assert torch.equal(one.rows[2].scored[:, P:], batch.response_mask)
