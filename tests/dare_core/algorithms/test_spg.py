"""SPG (docs/diffusion.md#blockwise-eubo, docs/algorithms.md#spg): the ELBO-like and EUBO bounds by hand, the q_i > 0 rule, the
N = 1 identity EUBO = l+ - (1/beta) log t, the sandwich loss, and what it forbids."""
import math

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.algorithms.spg import spg_bounds
from dare_core.batch import Batch
from dare_core.config import RLConfig, SamplerConfig
from dare_core.diffusion.masking import valid_region
from rl_reference import plain_logp
from tiny_models import tiny

EOS, MASK = 62, 63


def _batch(n=4, P=4, L=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (n, P + L), generator=g)
    ids[1, P + 3:] = EOS
    attn = torch.ones_like(ids)
    attn[0, :2] = 0
    valid = valid_region(ids[:, P:], EOS)
    return Batch(ids, attn, P, valid, [f"g{i}" for i in range(n)], torch.tensor([0.8, -0.5, 0.0, -1.2])[:n])


def _rl(**kw):
    return RLConfig(kl_beta=0.0, rows_per_forward=1, sampler=SamplerConfig(gen_length=8, steps=8, block_length=4, temperature=1.0), **kw)


def test_eubo_identity_for_one_row():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 1, 10, generator=g) * 4
    scored = torch.rand(3, 1, 10, generator=g) < 0.6
    scored[:, :, 0] = True
    frac = torch.tensor([[0.3], [0.7], [1.0]])
    lower, upper = spg_bounds(logp, scored, frac, 1.5)
    for b in range(3):
        sel = logp[b, 0][scored[b, 0]]
        assert lower[b].item() == pytest.approx(sel.mean().item(), rel=1e-5)
        assert upper[b].item() == pytest.approx(sel.mean().item() - math.log(frac[b, 0].item()) / 1.5, rel=1e-5)
    assert (upper >= lower - 1e-6).all()


def test_eubo_ignores_positions_with_zero_q():
    logp = torch.tensor([[[-1.0, -2.0, -1e4, 0.0], [-0.5, 0.0, 0.0, 0.0]]])  # p^beta of -1e4 underflows: q = 0
    scored = torch.tensor([[[True, True, True, False], [True, False, False, False]]])
    frac = torch.tensor([[0.75, 0.25]])
    lower, upper = spg_bounds(logp, scored, frac, 1.5)
    q0 = (math.exp(-1.5) / 0.75 + math.exp(-0.75) / 0.25) / 2
    q1 = math.exp(-3.0) / 0.75 / 2
    want = (math.log(q0) + math.log(q1)) / 2 / 1.5  # positions 2 (underflow) and 3 (never masked) ignored
    assert upper.item() == pytest.approx(want, rel=1e-5)
    assert lower.item() == pytest.approx(((-1 - 2 - 1e4) / 3 + -0.5) / 2, rel=1e-5)


@pytest.mark.parametrize("estimate", ["mix", "eubo", "elbo", "zero"])
def test_loss_by_hand(estimate):
    model = tiny("llada")
    algo = make_algo("spg", model, _rl(), logp_estimation=estimate, num_t=2, eubo_beta=1.5, mix_weight=0.5)
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    out = run_update(algo, model, batch, cs, None, None, backward=False)
    P, beta = batch.prompt_len, 1.5
    lv = batch.response_mask.sum(-1).double()
    lps = [plain_logp(model, r.noisy_ids, batch.input_ids, batch.attention_mask) for r in cs.rows]
    total = 0.0
    for b in range(len(batch)):
        per_row, q = [], torch.zeros(batch.input_ids.shape[1], dtype=torch.float64)
        for j, r in enumerate(cs.rows):
            sel = r.scored[b]
            assert not sel[:P].any() and not (sel[P:] & ~batch.response_mask[b]).any()
            t_hat = sel.sum().item() / lv[b].item()
            assert cs.info["mask_fraction"][b, j].item() == pytest.approx(t_hat)
            per_row.append(lps[j][b][sel].mean().item())
            q += torch.where(sel, torch.exp(beta * lps[j][b]) / t_hat, torch.zeros(()))
        q /= len(cs)
        lower = sum(per_row) / len(per_row)
        upper = torch.log(q[q > 0]).mean().item() / beta
        minus = {"mix": 0.5 * upper + 0.5 * lower, "eubo": upper, "elbo": lower, "zero": 0.0}[estimate]
        a = batch.advantages[b].item()
        total += -a * (lower if a > 0 else minus) * lv[b].item()
    assert float(out.loss) == pytest.approx(total / lv.sum().item(), rel=1e-4, abs=1e-6)


def test_positive_sample_gradient_is_the_elbo_like_bound():
    """Only a positive sample with A = 1: the loss is -l+ L_v / sum L_v."""
    model = tiny("llada")
    algo = make_algo("spg", model, _rl(), num_t=1)
    batch = _batch().select(torch.tensor([0]))
    batch.advantages[:] = 1.0
    cs = algo.corrupt(batch, (0, 0, 0))
    run_update(algo, model, batch, cs, None, None)
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    s = algo.score(model, batch, cs)[:, 0]  # [B, S] token log-probs of the row
    sel = cs.rows[0].scored
    (-(s[sel].mean())).backward()
    for a, b in zip(g1, model.parameters()):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-7)


def test_forbidden_configurations():
    with pytest.raises(ValueError, match="KL"):
        make_algo("spg", tiny("llada"), RLConfig(kl_beta=0.01))
    with pytest.raises(ValueError, match="masked"):
        make_algo("spg", tiny("sdar"), _rl())
    with pytest.raises(ValueError):
        make_algo("spg", tiny("llada"), _rl(), logp_estimation="upper")
