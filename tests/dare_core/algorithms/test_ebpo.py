"""EBPO (docs/diffusion.md#per-block-elbo, docs/algorithms.md#ebpo): the per-block composite ELBO as a sum of block terms scored by plain
per-block forwards, one sequence ratio exp(S - S_old) clipped in log space, ratio 1 at theta_old, no
overflow at |dS| = 1e3; on a masked diffusion model the response is one block."""
import math

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.batch import Batch
from dare_core.config import RLConfig, SamplerConfig
from dare_core.diffusion.masking import valid_region
from dare_core.diffusion.mc_laws import response_blocks
from rl_reference import kl, plain_logp, ppo
from tiny_models import tiny

EOS, MASK = 62, 63


def _batch(n=4, P=5, L=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (n, P + L), generator=g)
    ids[1, P + 4:] = EOS
    attn = torch.ones_like(ids)
    attn[2, :2] = 0  # a shorter prompt: its blocks shift with it
    ids[2, :2] = EOS
    valid = valid_region(ids[:, P:], EOS)
    return Batch(ids, attn, P, valid, [f"k{i}" for i in range(n)], torch.tensor([0.9, -0.4, 1.5, -1.0])[:n])


def _rl(**kw):
    sampler = SamplerConfig(gen_length=8, steps=8, block_length=4, temperature=1.0)
    return RLConfig(**{"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip": 3.0, "kl_beta": 0.0, "rows_per_forward": 2,
                       "sampler": sampler, **kw})


def _composite(model, batch, cs):
    """E_j = sum_b sum_{i in S_jb} |R_b|/m_jb log p(y_i | clean blocks < b, noisy block b): [B, N]."""
    P = batch.prompt_len
    if model.block_size is None:  # masked diffusion: the response is one block
        blocks = torch.zeros_like(batch.response_mask, dtype=torch.long)
    else:
        blocks = response_blocks(batch.attention_mask, P, model.block_size, "global")
    out = torch.zeros(len(batch), len(cs), dtype=torch.float64)
    for j, r in enumerate(cs.rows):
        lp = plain_logp(model, r.noisy_ids, batch.input_ids, batch.attention_mask)
        for b in range(len(batch)):
            for blk in blocks[b][batch.response_mask[b]].unique().tolist():
                in_b = (blocks[b] == blk) & batch.response_mask[b]
                hit = r.scored[b, P:] & in_b
                m, size = int(hit.sum()), int(in_b.sum())
                assert 1 <= m <= size
                out[b, j] += lp[b, P:][hit].sum() * size / m  # the block term
            assert not (r.scored[b, P:] & ~batch.response_mask[b]).any()
            assert (r.noisy_ids[b, P:][~batch.response_mask[b]] == MASK).all()  # tail_policy mask
    return out


@pytest.mark.parametrize("family,kl_beta", [("sdar", 0.0), ("sdar", 0.05), ("llada", 0.05)])
def test_loss_by_hand(family, kl_beta):
    model = tiny(family)
    algo = make_algo("ebpo", model, _rl(kl_beta=kl_beta, kl_estimator="k3"), mc_num=3)
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s = algo.score(model, batch, cs)
    e = _composite(model, batch, cs)
    torch.testing.assert_close(s.double(), e, rtol=1e-4, atol=1e-4)
    old = s + torch.tensor([-0.5, 0.3, 0.05, -0.1])[:, None]
    ref = s + 0.7
    out = run_update(algo, model, batch, cs, old, ref, backward=False)
    S = e.mean(1)
    want = 0.0
    for b in range(len(batch)):
        r = math.exp((S[b] - old[b].double().mean()).item())
        want += ppo(r, batch.advantages[b].item()) + kl_beta * kl((S[b] - ref[b].double().mean()).item(), "k3")
    assert float(out.loss) == pytest.approx(want / len(batch), rel=1e-4)


def test_ratio_one_at_theta_old_and_no_overflow():
    model = tiny("sdar")
    algo = make_algo("ebpo", model, _rl(), mc_num=2)
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        old = algo.score(model, batch, cs)
    out = run_update(algo, model, batch, cs, old)
    assert out.metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
    for shift in (1e3, -1e3):
        for dual in (3.0, 0.0):
            algo = make_algo("ebpo", model, _rl(dual_clip=dual), mc_num=2)
            model.zero_grad()
            out = run_update(algo, model, batch, cs, old + shift)
            assert math.isfinite(float(out.loss)), (shift, dual)
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), (shift, dual)


def test_masked_model_one_block_and_block_size_checked():
    algo = make_algo("ebpo", tiny("llada"), _rl(), mc_num=4)
    batch = _batch()
    cs = algo.corrupt(batch, (0, 0, 0))
    counts = torch.stack([r.scored[:, batch.prompt_len:].sum(-1) for r in cs.rows], 1)  # [B, N]
    for b in range(len(batch)):
        size = int(batch.response_mask[b].sum())
        # one cell per row, stratified over the N rows: the counts m are spread over {1..|R|}
        assert counts[b].min() >= 1 and counts[b].max() <= size
        assert len(set(counts[b].tolist())) > 1
    with pytest.raises(ValueError, match="block_length"):
        make_algo("ebpo", tiny("sdar"), _rl(sampler=SamplerConfig(gen_length=8, steps=8, block_length=8, temperature=1.0)))
