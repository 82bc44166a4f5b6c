"""Constant-memory backward passes (docs/diffusion.md#mc-elbo): proxy-gradient replay of a non-linear loss of
the rows' ELBOs, and per-row forward + backward of a separable loss, give the full-graph gradient."""
import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.algorithms.common import kl_estimate, ppo_clip_log_space
from dare_core.batch import Batch
from dare_core.config import RLConfig, SamplerConfig
from dare_core.diffusion.likelihood import elbo_rows, proxy_backward, separable_backward
from dare_core.diffusion.masking import valid_region
from dare_core.diffusion.mc_laws import count_rows
from dare_core.diffusion.seeding import sample_generators
from tiny_models import tiny

EOS, MASK = 62, 63


def _batch(model, n=4, P=4, L=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (n, P + L), generator=g)
    ids[1, P + 5:] = EOS
    attn = torch.ones_like(ids)
    attn[2, :2] = 0
    valid = valid_region(ids[:, P:], EOS)
    return Batch(ids, attn, P, valid, [f"p{i}" for i in range(n)], torch.tensor([1.0, -0.5, 0.7, -1.2])[:n])


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _seq_loss(e, old, ref, adv, beta=0.3):
    """A non-linear loss of the rows: log-space clipped sequence ratio and k2 KL on S = mean_j E_j."""
    s = e.mean(1)
    clip, _ = ppo_clip_log_space(s - old, adv, 0.2, 0.2, 3.0)
    return clip.sum() / len(s) + beta * kl_estimate(s, ref, "k2").sum() / len(s)


@pytest.mark.parametrize("N", [1, 3, 8])
def test_proxy_backward_equals_full_graph(N):
    model = tiny("llada").double()
    batch = _batch(model)
    gens = sample_generators((0, N, "proxy"), batch.uids)
    cs = count_rows(batch.input_ids, batch.prompt_len, batch.response_mask, batch.attention_mask[:, batch.prompt_len:], MASK, N, gens)
    with torch.no_grad():
        s0 = elbo_rows(model, cs.rows, batch.input_ids, batch.attention_mask).mean(1)
    old, ref = s0 + torch.tensor([0.1, -0.3, 0.05, 0.4]), s0 - 0.5  # some ratios clipped, some not
    adv = batch.advantages

    def rows_of(idx):
        return elbo_rows(model, [cs.rows[i] for i in idx], batch.input_ids, batch.attention_mask)

    full = _seq_loss(rows_of(list(range(N))), old, ref, adv)
    full.backward()
    g_full = _grads(model)
    model.zero_grad()
    loss, _ = proxy_backward(cs, 1, rows_of, lambda e: (_seq_loss(e, old, ref, adv), {}), lambda x: x.backward())
    assert _rel(_grads(model), g_full) < 1e-5
    assert float(loss) == pytest.approx(float(full.detach()), rel=1e-4)


def _rl(**kw):
    return RLConfig(**{"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip": 3.0, "kl_beta": 0.2, "kl_estimator": "k2", **kw})


@pytest.mark.parametrize("name,family,N", [("espo", "llada", 1), ("espo", "Dream", 3), ("espo", "llada", 8),
                                           ("ebpo", "sdar", 1), ("ebpo", "sdar", 3), ("ebpo", "sdar", 8)])
def test_algorithm_replay_equals_full_graph(name, family, N):
    model = tiny(family).double()
    batch = _batch(model)
    sampler = SamplerConfig(gen_length=8, steps=8, block_length=model.block_size or 8, temperature=1.0)
    grads = []
    for rows in (1, 100):  # one row per forward (replay) vs all rows in one graph
        algo = make_algo(name, model, _rl(rows_per_forward=rows, sampler=sampler), mc_num=N)
        cs = algo.corrupt(batch, (0, 1, 0))
        with torch.no_grad():
            s = algo.score(model, batch, cs)
        old = s + torch.linspace(-0.6, 0.6, s.numel()).view_as(s)
        model.zero_grad()
        out = run_update(algo, model, batch, cs, old, s - 0.4)
        grads.append((_grads(model), float(out.loss)))
    assert _rel(grads[0][0], grads[1][0]) < 1e-5
    assert grads[0][1] == pytest.approx(grads[1][1], rel=1e-4)


@pytest.mark.parametrize("N", [1, 3, 8])
def test_separable_backward_equals_full_graph(N):
    """BGPO's per-row backward (KL off: the loss is a mean of per-row terms) against one graph."""
    model = tiny("llada").double()
    batch = _batch(model)
    algo = make_algo("bgpo", model, _rl(kl_beta=0.0, rows_per_forward=1), mc_num=N)
    cs = algo.corrupt(batch, (0, 2, 0))
    with torch.no_grad():
        s = algo.score(model, batch, cs)
    old = s + torch.linspace(-0.5, 0.5, s.numel()).view_as(s)
    out = run_update(algo, model, batch, cs, old)
    g_rows = _grads(model)
    model.zero_grad()
    e = algo.score(model, batch, cs)  # all rows, one graph
    full, _ = algo._row_loss(e, old, batch.advantages)
    (full.sum() / (N * len(batch))).backward()
    assert _rel(g_rows, _grads(model)) < 1e-5
    assert float(out.loss) == pytest.approx(float(full.detach().sum() / (N * len(batch))), rel=1e-4)


def test_separable_backward_sums_chunks():
    calls = []

    class Rows:
        def __len__(self):
            return 5

    def chunk_loss(idx):
        calls.append(list(idx))
        return torch.tensor(float(sum(idx))), {"m": 1.0}

    total, metrics = separable_backward(Rows(), 2, chunk_loss, lambda x: None)
    assert calls == [[0, 1], [2, 3], [4]] and total == 10.0 and metrics == {"m": 3.0}
