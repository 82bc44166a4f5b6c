"""ESPO (docs/diffusion.md#mc-elbo law (c), docs/algorithms.md#espo): the complementary-mask rows, the sequence log-ratio
(S - S_old)/L_max clipped against the sequence advantage, and k2 on the raw ELBO divided by L_max."""
import math

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.batch import Batch
from dare_core.config import RLConfig, SamplerConfig
from dare_core.diffusion.masking import valid_region
from rl_reference import plain_logp, ppo
from tiny_models import tiny

EOS, MASK = 62, 63
L_MAX = 16


def _batch(n=4, P=4, L=L_MAX, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (n, P + L), generator=g)
    ids[1, P + 5:] = EOS
    ids[3, P + 11:] = EOS
    attn = torch.ones_like(ids)
    attn[0, :2] = 0
    valid = valid_region(ids[:, P:], EOS)
    return Batch(ids, attn, P, valid, [f"e{i}" for i in range(n)], torch.tensor([1.0, -0.7, 0.4, -1.3])[:n])


def _rl(**kw):
    sampler = SamplerConfig(gen_length=L_MAX, steps=L_MAX, block_length=L_MAX, temperature=1.0)
    return RLConfig(**{"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip": 3.0, "kl_beta": 0.5, "kl_estimator": "k2",
                       "rows_per_forward": 3, "sampler": sampler, **kw})


def _raw_elbo(model, batch, cs):
    """S per sequence by hand: rows come in (masked, complement) pairs with weights (n+1)/l and
    (n+1)/(n-l); S = (1/N) sum_j 1/2 (E_j + E_j^c)."""
    P, B = batch.prompt_len, len(batch)
    pairs = len(cs) // 2
    S = torch.zeros(B, dtype=torch.float64)
    for j in range(pairs):
        first, comp = cs.rows[2 * j], cs.rows[2 * j + 1]
        lp1 = plain_logp(model, first.noisy_ids, batch.input_ids, batch.attention_mask)
        lp2 = plain_logp(model, comp.noisy_ids, batch.input_ids, batch.attention_mask)
        for b in range(B):
            n = int(batch.response_mask[b].sum())
            m1, m2 = first.scored[b], comp.scored[b]
            assert torch.equal((m1 | m2)[P:], batch.response_mask[b]) and not (m1 & m2).any()
            l = int(m1.sum())
            e1 = lp1[b][m1].sum() * (n + 1) / l if l else 0.0
            e2 = lp2[b][m2].sum() * (n + 1) / (n - l) if n - l else 0.0
            S[b] += 0.5 * (e1 + e2) / pairs
    return S


@pytest.mark.parametrize("family,N", [("llada", 2), ("Dream", 1)])
def test_loss_by_hand(family, N):
    model = tiny(family)
    rl = _rl()
    algo = make_algo("espo", model, rl, mc_num=N)
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    assert len(cs) == 2 * N
    with torch.no_grad():
        s = algo.score(model, batch, cs)  # raw per-row ELBOs [B, 2N]
    raw = _raw_elbo(model, batch, cs)
    torch.testing.assert_close(s.double().mean(1), raw, rtol=1e-4, atol=1e-4)
    old = s + torch.tensor([-6.0, 1.0, 4.0, -0.5])[:, None]  # log-ratios of +-0.4, 0.06, -0.25, 0.03 after / L_max
    ref = s - torch.tensor([3.0, -2.0, 1.0, 5.0])[:, None]
    out = run_update(algo, model, batch, cs, old, ref, backward=False)
    total, total_norm_kl = 0.0, 0.0
    for b in range(len(batch)):
        a = batch.advantages[b].item()
        r = math.exp((raw[b] - old[b].double().mean()).item() / L_MAX)
        d_raw = (raw[b] - ref[b].double().mean()).item()
        total += ppo(r, a) + 0.5 * 0.5 * d_raw ** 2 / L_MAX
        total_norm_kl += ppo(r, a) + 0.5 * 0.5 * (d_raw / L_MAX) ** 2
    assert float(out.loss) == pytest.approx(total / 4, rel=1e-4)
    # k2 of the normalised score would be smaller by a factor L_max: not what ESPO does
    assert abs(total / 4 - total_norm_kl / 4) > 1e-2


def test_ratio_one_at_theta_old_and_log_space_clip():
    model = tiny("llada")
    algo = make_algo("espo", model, _rl(kl_beta=0.0))
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        old = algo.score(model, batch, cs)
    out = run_update(algo, model, batch, cs, old)
    assert out.metrics["ratio"] == pytest.approx(1.0, abs=1e-6) and out.metrics["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    for shift in (1e3 * L_MAX, -1e3 * L_MAX):  # |log-ratio| = 1e3 after the 1/L_max scaling
        for dual in (3.0, 0.0):
            algo = make_algo("espo", model, _rl(kl_beta=0.0, dual_clip=dual))
            model.zero_grad()
            out = run_update(algo, model, batch, cs, old + shift)
            assert math.isfinite(float(out.loss))
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fresh_masks_per_iteration_without_complement():
    model = tiny("llada")
    algo = make_algo("espo", model, _rl(), mc_num=3, reduce_var=False)
    batch = _batch()
    one, two = algo.corrupt(batch, (0, 0, 0)), algo.corrupt(batch, (0, 0, 1))
    assert len(one) == 3
    assert any(not torch.equal(a.scored, b.scored) for a, b in zip(one.rows, two.rows))
    n = batch.response_mask.sum(-1)
    for r in one.rows:  # law (c): l in {0..n}, weight (n+1)/l
        l = r.scored.sum(-1)
        assert (l <= n).all()
        w = r.elbo_weight()
        for b in range(len(batch)):
            if l[b]:
                assert torch.allclose(w[b][r.scored[b]], (n[b] + 1) / l[b].float())
