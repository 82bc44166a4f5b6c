"""BGPO (docs/diffusion.md#mc-elbo, docs/algorithms.md#bgpo): stratified law (b) rows, per-row ratio 1 + D (A > 0) or exp D
(A <= 0), clipped and averaged over rows, by hand; ratio 1 at theta = theta_old; never NaN."""
import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.batch import Batch
from dare_core.config import RLConfig, SamplerConfig
from dare_core.diffusion.masking import valid_region
from rl_reference import kl, plain_logp, ppo
from tiny_models import tiny

EOS, MASK = 62, 63


def _batch(n=4, P=4, L=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (n, P + L), generator=g)
    ids[1, P + 3:] = EOS
    attn = torch.ones_like(ids)
    attn[2, :1] = 0
    valid = valid_region(ids[:, P:], EOS)
    return Batch(ids, attn, P, valid, [f"b{i}" for i in range(n)], torch.tensor([0.8, -0.6, 0.0, 1.1])[:n])


def _by_hand(model, batch, cs, old, ref, z, rl):
    """(1/N) sum_j clip(rho_j) per sequence, mean over sequences (+ KL on mean_j E_j / Z)."""
    P, B = batch.prompt_len, len(batch)
    N = len(cs)
    e = torch.zeros(B, N, dtype=torch.float64)
    for j, r in enumerate(cs.rows):
        lp = plain_logp(model, r.noisy_ids, batch.input_ids, batch.attention_mask)
        for b in range(B):
            n = int(batch.response_mask[b].sum())
            sel = r.scored[b]
            l = int(sel.sum())
            assert 1 <= l <= n and not sel[:P].any() and not (sel[P:] & ~batch.response_mask[b]).any()
            e[b, j] = lp[b][sel].sum() * n / l / z[b]
    total = 0.0
    for b in range(B):
        a = batch.advantages[b].item()
        for j in range(N):
            d = (e[b, j] - old[b, j].double()).item()
            rho = 1 + d if a > 0 else torch.exp(torch.tensor(d)).item()
            total += ppo(rho, a, rl.clip_eps_low, rl.clip_eps_high, rl.dual_clip) / N
        if ref is not None and rl.kl_beta > 0:
            total += rl.kl_beta * kl((e[b].mean() - ref[b].double().mean()).item(), rl.kl_estimator)
    return total / B, e


@pytest.mark.parametrize("family,norm,kl_beta", [("llada", "auto", 0.0), ("Dream", "none", 0.0), ("llada", "valid", 0.1),
                                                 ("sdar", "auto", 0.0)])
def test_loss_by_hand(family, norm, kl_beta):
    model = tiny(family)
    sampler = SamplerConfig(gen_length=8, steps=8, block_length=model.block_size or 8, temperature=1.0)
    rl = RLConfig(clip_eps_low=0.2, clip_eps_high=0.25, dual_clip=3.0, kl_beta=kl_beta, kl_estimator="k2", rows_per_forward=2, sampler=sampler)
    algo = make_algo("bgpo", model, rl, mc_num=4, elbo_norm=norm)
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    lv = batch.response_mask.float().sum(-1)
    want_z = {"none": torch.ones(4), "valid": lv, "auto": lv if family == "sdar" else torch.full((4,), 8.0)}[norm]
    assert torch.equal(cs.info["z"], want_z)
    with torch.no_grad():
        s = algo.score(model, batch, cs)
    old = s + torch.linspace(-0.3, 0.3, s.numel()).view_as(s)
    ref = s - 0.2
    out = run_update(algo, model, batch, cs, old, ref, backward=False)
    want, e = _by_hand(model, batch, cs, old, ref, cs.info["z"], rl)
    torch.testing.assert_close(s.double(), e, rtol=1e-4, atol=1e-5)
    assert float(out.loss) == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_ratio_one_at_theta_old():
    model = tiny("llada")
    algo = make_algo("bgpo", model, mc_num=5)
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        old = algo.score(model, batch, cs)
    out = run_update(algo, model, batch, cs, old)
    assert out.metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert out.metrics["clipfrac_hi"] == 0 and out.metrics["clipfrac_lo"] == 0
    e = algo.score(model, batch, cs)
    _, clip = algo._row_loss(e, old, batch.advantages)
    torch.testing.assert_close(clip["ratio"], torch.ones_like(e), atol=1e-6, rtol=0)


def test_row_ratio_forms_and_no_nan():
    model = tiny("llada")
    algo = make_algo("bgpo", model, RLConfig(dual_clip=3.0))
    d = torch.linspace(-5, 5, 41)
    for a in (1.0, -1.0, 0.0):
        leaf = d.clone().requires_grad_(True)
        e = leaf[None]
        per_row, clip = algo._row_loss(e, torch.zeros_like(e), torch.tensor([a]))
        want = 1 + d if a > 0 else torch.exp(d)
        torch.testing.assert_close(clip["ratio"][0], want)
        per_row.sum().backward()
        assert torch.isfinite(per_row).all() and torch.isfinite(leaf.grad).all()
    # the reference's exp(log(1 + D)) is NaN below D = -1; 1 + D is not, and the clip handles it
    per_row, _ = algo._row_loss(torch.tensor([[-3.0]]), torch.zeros(1, 1), torch.tensor([1.0]))
    assert per_row.item() == pytest.approx(2.0)  # max(-A (1 + D), -A clip(1 + D)) = max(2, -0.8)
