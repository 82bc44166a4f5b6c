"""The Monte-Carlo corruption laws of the RL estimators (docs/diffusion.md#corruption-laws, docs/diffusion.md#mask-families, docs/diffusion.md#coupled-passes, docs/diffusion.md#mc-elbo, docs/diffusion.md#per-block-elbo, docs/diffusion.md#blockwise-eubo): each is
unbiased for the exact value of a toy model whose log-probabilities depend on the masked set, the
stratified counts are marginally uniform, the coupled passes partition V, and masks come only from
per-sample generators."""
import itertools
import math
import random

import pytest
import torch
from scipy import integrate
from scipy.stats import chisquare, kstest

from dare_core.diffusion.likelihood import elbo_rows
from dare_core.diffusion.masking import valid_region
from dare_core.diffusion.mc_laws import (blockwise_rows, count_rows, coupled_rows, per_block_rows, response_blocks,
                                         stratified_counts, tail_region)
from dare_core.diffusion.seeding import generator, sample_generators

MASK, EOS, V = 9, 8, 10


class TableModel:
    """A toy masked-diffusion model: its logits at every position are a fixed random table entry
    keyed by the set of masked response positions, so log p_i(S) is known for every S."""

    block_size, logits_chunk = None, 0

    def __init__(self, prompt_len: int, resp_len: int, seed: int = 0):
        self.P, self.L = prompt_len, resp_len
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(2 ** resp_len, prompt_len + resp_len, V, generator=g, dtype=torch.float64) * 1.5

    def key(self, noisy: torch.Tensor) -> torch.Tensor:
        bits = (noisy[:, self.P:] == MASK).long() * (2 ** torch.arange(self.L))
        return bits.sum(-1)

    def scored_logits(self, noisy, attention_mask, rows):
        return self.table[self.key(noisy)][rows]

    def logp(self, masked: tuple, targets: torch.Tensor) -> torch.Tensor:
        """[L] log p(y_i | S masked) of the response positions, S given as a tuple of bools."""
        k = sum(2 ** i for i, m in enumerate(masked) if m)
        return torch.log_softmax(self.table[k].float(), -1)[self.P:].double().gather(-1, targets[self.P:, None]).squeeze(-1)


def _toy_batch(draws: int):
    """P = 2, response [a, b, c, EOS]: V = the first 3 positions (first EOS included), a tail of 1."""
    seq = torch.tensor([1, 2, 3, 4, EOS, EOS])
    ids = seq.expand(draws, -1).clone()
    attn = torch.ones_like(ids)
    valid = valid_region(ids[:, 2:], EOS)
    return ids, attn, valid


def _exact(model: TableModel, seq: torch.Tensor, n: int = 3) -> float:
    """1.3's identity: sum_l (1/l) avg_{|S|=l} sum_{i in S} log p_i(S), the tail always masked."""
    total = 0.0
    for l in range(1, n + 1):
        subsets = [s for s in itertools.combinations(range(n), l)]
        acc = 0.0
        for s in subsets:
            masked = tuple(i in s or i >= n for i in range(model.L))
            acc += model.logp(masked, seq)[list(s)].sum().item()
        total += acc / len(subsets) / l
    return total


def _close(values: torch.Tensor, exact: float):
    se = values.std().item() / math.sqrt(values.numel())
    assert abs(values.mean().item() - exact) < 4 * se + 1e-6, (values.mean().item(), exact, se)


@pytest.mark.parametrize("rows,with_zero,complement", [(1, False, False), (4, False, False), (1, True, False),
                                                       (3, True, False), (2, True, True), (1, True, True)])
def test_count_laws_unbiased_on_the_toy(rows, with_zero, complement):
    draws = 12000 // (rows * (2 if complement else 1))
    model = TableModel(2, 4)
    ids, attn, valid = _toy_batch(draws)
    cs = count_rows(ids, 2, valid, attn[:, 2:], MASK, rows, sample_generators((rows, with_zero, "u"), list(range(draws))),
                    with_zero=with_zero, complement=complement)
    assert len(cs) == (2 * rows if complement else rows)
    # the tail is MASK in every row and never scored
    for r in cs.rows:
        assert (r.noisy_ids[:, 5] == MASK).all() and not r.scored[:, 5].any() and not r.scored[:, :2].any()
        assert torch.isfinite(r.elbo_weight()).all()
    est = elbo_rows(model, cs.rows, ids, attn).double().mean(1)  # S = mean over rows
    _close(est, _exact(model, ids[0]))


def test_law_c_edge_cases_contribute_zero():
    """l = 0 masks nothing and its row is 0; l = n leaves an empty complement whose row is 0."""
    draws = 3000
    model = TableModel(2, 4)
    ids, attn, valid = _toy_batch(draws)
    cs = count_rows(ids, 2, valid, attn[:, 2:], MASK, 1, sample_generators((5,), list(range(draws))), with_zero=True, complement=True)
    e = elbo_rows(model, cs.rows, ids, attn)
    counts = cs.rows[0].scored.sum(-1)
    assert (counts == 0).any() and (counts == 3).any()
    assert torch.isfinite(e).all()
    assert (e[counts == 0, 0] == 0).all() and (e[counts == 3, 1] == 0).all()
    # p = l/(n+1) and p^c = (n-l)/(n+1): weights (n+1)/l and (n+1)/(n-l)
    w, wc = cs.rows[0].elbo_weight()[:, 2:5], cs.rows[1].elbo_weight()[:, 2:5]
    for b in range(50):
        l = int(counts[b])
        if 0 < l:
            assert torch.allclose(w[b][cs.rows[0].scored[b, 2:5]], torch.tensor(4.0 / l))
        if l < 3:
            assert torch.allclose(wc[b][cs.rows[1].scored[b, 2:5]], torch.tensor(4.0 / (3 - l)))
        assert not (cs.rows[0].scored[b] & cs.rows[1].scored[b]).any()
        assert torch.equal(cs.rows[0].scored[b] | cs.rows[1].scored[b], torch.cat([torch.zeros(2, dtype=torch.bool), valid[b]]))


def test_coupled_pair_unbiased_for_its_time_range():
    """A (weight 1/t) and B (weight 1/(1-t)) are ELBO samples at t and 1 - t: their sum has mean
    2 * E_{t ~ U(0.2, 0.8)} f(t), f(t) = E_{z ~ q_t}[(1/t) sum_masked log p]."""
    draws = 12000
    model = TableModel(2, 4)
    ids, attn, valid = _toy_batch(draws)
    cs = coupled_rows(ids, 2, valid, attn[:, 2:], MASK, sample_generators((7,), list(range(draws))), include_full=False)
    pair = elbo_rows(model, cs.rows, ids, attn).double().sum(1)
    n, seq = 3, ids[0]
    terms = []
    for s in itertools.product([False, True], repeat=n):
        l = sum(s)
        if l:
            terms.append((l, model.logp(s + (True,), seq)[[i for i in range(n) if s[i]]].sum().item()))

    def f(t):
        return sum(t ** (l - 1) * (1 - t) ** (n - l) * c for l, c in terms)

    want = 2 * integrate.quad(f, 0.2, 0.8)[0] / 0.6
    _close(pair, want)


def test_stratified_counts_marginally_uniform_and_spread():
    n, N, draws = 7, 3, 7000
    for with_zero in (False, True):
        lo = 0 if with_zero else 1
        per_row = [[] for _ in range(N)]
        for d in range(draws):
            c = stratified_counts(n, N, generator(d, "strat", with_zero), with_zero)
            assert len(set(c)) == N  # N <= n: the rows use distinct counts
            for j, x in enumerate(c):
                per_row[j].append(x)
        for xs in per_row:
            hist = torch.bincount(torch.tensor(xs), minlength=n + 1)[lo:]
            assert hist.numel() == n + 1 - lo and hist.sum() == draws
            assert chisquare(hist.numpy()).pvalue > 1e-3
    # N = n: one draw covers every count once
    assert sorted(stratified_counts(5, 5, generator(0, "x"))) == [1, 2, 3, 4, 5]
    assert sorted(stratified_counts(5, 6, generator(0, "x"), with_zero=True)) == [0, 1, 2, 3, 4, 5]


def test_count_rows_counts_follow_the_stratified_law():
    draws, n = 4000, 5
    ids = torch.randint(0, 8, (draws, 3 + 6))
    valid = torch.zeros(draws, 6, dtype=torch.bool)
    valid[:, :n] = True
    gens = sample_generators((3,), list(range(draws)))
    cs = count_rows(ids, 3, valid, torch.ones(draws, 6), MASK, 2, gens, with_zero=True)
    for r in cs.rows:
        counts = r.scored.sum(-1)
        assert chisquare(torch.bincount(counts, minlength=n + 1).numpy()).pvalue > 1e-3
        assert torch.allclose(r.p, counts / (n + 1))
        assert not r.scored[:, :3].any() and not r.scored[:, 3 + n:].any()


# --------------------------------------------------------------------------- block toy


def _block_exact_and_lookup(blocks: list):
    """blocks: lists of response positions. Returns (sum_b ELBO_b, logp(i, masked_in_block))."""
    g = torch.Generator().manual_seed(1)
    table = {}
    for blk in blocks:
        for l in range(0, len(blk) + 1):
            for s in itertools.combinations(blk, l):
                for i in blk:
                    table[(i, frozenset(s))] = -float(torch.rand((), generator=g, dtype=torch.float64)) * 3
    exact = 0.0
    for blk in blocks:
        for l in range(1, len(blk) + 1):
            subsets = list(itertools.combinations(blk, l))
            exact += sum(sum(table[(i, frozenset(s))] for i in s) for s in subsets) / len(subsets) / l
    return exact, table


def _block_estimates(cs, P, blocks, table):
    draws = cs.rows[0].scored.shape[0]
    block_of = {i: b for b, blk in enumerate(blocks) for i in blk}
    out = torch.zeros(draws, dtype=torch.float64)
    for r in cs.rows:
        sc, w = r.scored[:, P:], r.elbo_weight()[:, P:].double()
        for d in range(draws):
            masked = sc[d].nonzero().squeeze(-1).tolist()
            in_block = {b: frozenset(i for i in masked if block_of[i] == b) for b in range(len(blocks))}
            out[d] += sum(w[d, i].item() * table[(i, in_block[block_of[i]])] for i in masked)
    return out / len(cs)


@pytest.mark.parametrize("P,law", [(2, "per_block"), (2, "global"), (3, "per_block")])
def test_block_composite_unbiased(P, law):
    """Blocks of 2 over the compact global coordinate: P = 2 gives two full response blocks of a
    4-token response; P = 3 a partial first block (sizes 1, 2, 1)."""
    draws, bs, L = 3000, 2, 4
    ids = torch.randint(0, 8, (draws, P + L))
    attn = torch.ones_like(ids)
    valid = torch.ones(draws, L, dtype=torch.bool)
    blk = response_blocks(attn, P, bs, "global")
    blocks = [[i for i in range(L) if blk[0, i] == b] for b in blk[0].unique().tolist()]
    exact, table = _block_exact_and_lookup(blocks)
    gens = sample_generators((P, law), list(range(draws)))
    if law == "per_block":
        cs = per_block_rows(ids, P, valid, attn[:, P:], MASK, blk, 2, gens)
        for r in cs.rows:  # every block has 1..|R_b| masks in every row
            for b in blocks:
                c = r.scored[:, P:][:, b].sum(-1)
                assert (c >= 1).all() and (c <= len(b)).all()
    else:
        cs = count_rows(ids, P, valid, attn[:, P:], MASK, 2, gens)
    _close(_block_estimates(cs, P, blocks, table), exact)


def test_per_block_counts_uniform_and_stratified():
    draws, P, L, bs, N = 3000, 1, 7, 4, 3
    ids = torch.randint(0, 8, (draws, P + L))
    attn = torch.ones_like(ids)
    blk = response_blocks(attn, P, bs, "global")  # response blocks of sizes 3 and 4
    assert blk[0].tolist() == [0, 0, 0, 1, 1, 1, 1]
    cs = per_block_rows(ids, P, torch.ones(draws, L, dtype=torch.bool), attn[:, P:], MASK, blk, N,
                        sample_generators((9,), list(range(draws))))
    for b, size in ((0, 3), (1, 4)):
        cols = (blk[0] == b).nonzero().squeeze(-1) + P
        counts = torch.stack([r.scored[:, cols].sum(-1) for r in cs.rows], 1)  # [draws, N]
        for j in range(N):
            assert chisquare(torch.bincount(counts[:, j], minlength=size + 1)[1:].numpy()).pvalue > 1e-3
            w = cs.rows[j].elbo_weight()[:, cols]
            hit = cs.rows[j].scored[:, cols]
            assert torch.allclose(w[hit], (size / counts[:, j:j + 1].float()).expand_as(w)[hit])
        if N <= size:  # the rows of one block sit in distinct strata: distinct counts
            assert all(len(set(c.tolist())) == N for c in counts)


# --------------------------------------------------------------------------- coupled law


def test_coupled_partition_weights_and_t():
    steps, n, L, P = 10, 100, 64, 3
    ids = torch.randint(0, 8, (n, P + L))
    resp = ids[:, P:]
    resp[:, 40:] = EOS
    resp[::3, 20:] = EOS  # shorter answers
    valid = valid_region(resp, EOS)
    attn = torch.ones_like(ids)
    ts, patterns = [], set()
    for step in range(steps):
        cs = coupled_rows(ids, P, valid, attn[:, P:], MASK, sample_generators((0, step, 0, "coupled"), list(range(n))))
        a, b, f = (r.scored[:, P:] for r in cs.rows)
        t = cs.info["t"]
        assert torch.equal(a | b, valid) and not (a & b).any() and torch.equal(f, valid)
        wa, wb, wf = (r.elbo_weight()[:, P:] for r in cs.rows)
        assert torch.allclose(wa[a], (1 / t)[:, None].expand_as(wa)[a])
        assert torch.allclose(wb[b], (1 / (1 - t))[:, None].expand_as(wb)[b])
        assert torch.equal(wf[f], torch.ones(int(f.sum())))
        tail = ~valid
        for r in cs.rows:  # the tail is MASK and unscored in every pass; the prompt is clean
            assert (r.noisy_ids[:, P:][tail] == MASK).all() and not r.scored[:, :P].any()
            assert torch.equal(r.noisy_ids[:, :P], ids[:, :P])
        ts.append(t)
        patterns |= {tuple(row.tolist()) for row in a}
    t = torch.cat(ts)
    assert len(set(t.tolist())) == t.numel()  # t varies across samples and steps
    assert kstest(((t - 0.2) / 0.6).numpy(), "uniform").pvalue > 1e-3
    assert len(patterns) == steps * n  # no two (sample, step) pairs share a mask


def test_coupled_constant_logit_stub():
    """With logits that ignore the input, s_i = 1/2 (1 + w_i) log q_i: each token's weight is
    applied in exactly one of the A/B passes, plus the F pass."""
    from algo_helpers import make_algo
    from dare_core.batch import Batch

    class Stub:
        block_size, logits_chunk, mask_token_id, eos_token_id = None, 0, MASK, EOS

        def __init__(self):
            self.logits = torch.randn(V, generator=torch.Generator().manual_seed(3))

        def scored_logits(self, noisy, attention_mask, rows):
            return self.logits.expand(*noisy.shape, V)[rows]

    stub = Stub()
    P, L = 2, 6
    ids = torch.randint(0, 8, (5, P + L), generator=torch.Generator().manual_seed(0))
    ids[1, P + 3:] = EOS
    attn = torch.ones_like(ids)
    valid = valid_region(ids[:, P:], EOS)
    batch = Batch(ids, attn, P, valid, list("abcde"), torch.ones(5))
    algo = make_algo("coupled_grpo", stub)
    cs = algo.corrupt(batch, (0, 1, 0))
    s = algo.score(stub, batch, cs)
    logq = torch.log_softmax(stub.logits, -1)[ids]
    t = cs.info["t"][:, None]
    in_a = cs.rows[0].scored
    w = torch.where(in_a, 1 / t, 1 / (1 - t))
    want = torch.where(cs.scored, 0.5 * (1 + w) * logq, torch.zeros(()))
    torch.testing.assert_close(s, want.float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(cs.scored[:, P:], valid)


# --------------------------------------------------------------------------- SPG's block-wise law


def test_blockwise_law_one_block():
    """num_t = 1: the chosen block has m in [1, |b ∩ V|] masked tokens, everything after it (and
    outside V) is MASK, earlier valid tokens are clean unless hit by the 0.15 context noise."""
    P, L, bs, n = 4, 12, 4, 400
    ids = torch.randint(0, 8, (n, P + L))
    ids[:, P + 9:] = EOS
    ids[::2, P + 5:] = EOS
    attn = torch.ones_like(ids)
    attn[::3, :2] = 0
    valid = valid_region(ids[:, P:], EOS)
    cs = blockwise_rows(ids, attn, P, valid, MASK, bs, 1, sample_generators((1,), list(range(n))), p_mask_prompt=0.0)
    r = cs.rows[0]
    noisy, sc = r.noisy_ids[:, P:] == MASK, r.scored[:, P:]
    blk = torch.arange(L) // bs
    chosen_blocks = []
    for b in range(n):
        # the chosen block: the first with a scored valid token that is followed only by masks
        first = int(sc[b].nonzero()[0])
        block = int(blk[first])
        chosen_blocks.append(block)
        in_b = (blk == block) & valid[b]
        m = int((noisy[b] & in_b).sum())
        assert 1 <= m <= int(in_b.sum())
        assert noisy[b][blk > block].all() and noisy[b][~valid[b]].all()
        assert not noisy[b][blk < block].any()  # no context noise at p_mask_prompt = 0
        assert torch.equal(sc[b], noisy[b] & valid[b])
        assert r.noisy_ids[b, :P].ne(MASK).all()
        assert cs.info["mask_fraction"][b, 0] == pytest.approx(float(sc[b].sum()) / float(valid[b].sum()))
    assert len(set(chosen_blocks)) > 1
    # with context noise, masked earlier tokens are scored but padding is never masked
    cs = blockwise_rows(ids, attn, P, valid, MASK, bs, 2, sample_generators((2,), list(range(n))), p_mask_prompt=0.15)
    for r in cs.rows:
        assert not (r.noisy_ids[:, :P][attn[:, :P] == 0] == MASK).any()
        assert not r.scored[:, :P].any()
        assert torch.equal(r.scored[:, P:], (r.noisy_ids[:, P:] == MASK) & valid)


# --------------------------------------------------------------------------- seeding discipline


def _laws(ids, attn, P, valid, gens):
    blk = response_blocks(attn, P, 4, "global")
    return {
        "count": count_rows(ids, P, valid, attn[:, P:], MASK, 3, gens()),
        "count_c": count_rows(ids, P, valid, attn[:, P:], MASK, 2, gens(), with_zero=True, complement=True),
        "coupled": coupled_rows(ids, P, valid, attn[:, P:], MASK, gens()),
        "per_block": per_block_rows(ids, P, valid, attn[:, P:], MASK, blk, 2, gens()),
        "blockwise": blockwise_rows(ids, attn, P, valid, MASK, 4, 2, gens()),
    }


def _same(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a.rows, b.rows):
        assert torch.equal(ra.noisy_ids, rb.noisy_ids) and torch.equal(ra.scored, rb.scored)
        assert torch.equal(ra.elbo_weight(), rb.elbo_weight())


def _response_part(cs, P):
    return [(r.noisy_ids[:, P:], r.scored[:, P:], r.elbo_weight()[:, P:]) for r in cs.rows]


def test_laws_shared_isolated_and_batch_invariant():
    P, L, n = 5, 12, 6
    ids = torch.randint(0, 8, (n, P + L), generator=torch.Generator().manual_seed(4))
    ids[2, P + 6:] = EOS
    attn = torch.ones_like(ids)
    attn[1, :2] = 0
    valid = valid_region(ids[:, P:], EOS)
    uids = [f"u{i}" for i in range(n)]
    torch_state, py_state = torch.random.get_rng_state(), random.getstate()
    first = _laws(ids, attn, P, valid, lambda: sample_generators((0, 5, 1), uids))
    again = _laws(ids, attn, P, valid, lambda: sample_generators((0, 5, 1), uids))
    other = _laws(ids, attn, P, valid, lambda: sample_generators((0, 6, 1), uids))
    assert torch.equal(torch.random.get_rng_state(), torch_state) and random.getstate() == py_state
    idx = torch.tensor([3, 1])
    alone = _laws(ids[idx], attn[idx], P, valid[idx], lambda: sample_generators((0, 5, 1), [uids[i] for i in idx]))
    # one more column of left padding for everybody (a wider prompt elsewhere in the batch)
    pad = lambda t, v: torch.cat([torch.full((t.shape[0], 1), v, dtype=t.dtype), t], 1)  # noqa: E731
    wider = _laws(pad(ids, EOS), pad(attn, 0), P + 1, valid, lambda: sample_generators((0, 5, 1), uids))
    for name in first:
        _same(first[name], again[name])
        assert any(not torch.equal(a.scored, b.scored) for a, b in zip(first[name].rows, other[name].rows)), name
        _same(first[name].select(idx), alone[name])
        for (na, sa, wa), (nb, sb, wb) in zip(_response_part(first[name], P), _response_part(wider[name], P + 1)):
            assert torch.equal(na, nb) and torch.equal(sa, sb) and torch.equal(wa, wb), name
        # the prompt noise (SPG) hits the same real prompt tokens whatever the padding
        for ra, rb in zip(first[name].rows, wider[name].rows):
            assert torch.equal(ra.noisy_ids[:, :P], rb.noisy_ids[:, 1:P + 1]), name


def test_tail_policy():
    valid = torch.tensor([[True, True, False, False]])
    canvas = torch.ones(1, 4)
    assert tail_region(valid, canvas, "mask").tolist() == [[False, False, True, True]]
    assert tail_region(valid, canvas, "keep") is None
    with pytest.raises(ValueError):
        tail_region(valid, canvas, "drop")
    ids = torch.tensor([[1, 2, 3, 4, EOS, EOS]])
    cs = count_rows(ids, 2, valid, canvas, MASK, 2, [generator(0)], tail_policy="keep")
    for r in cs.rows:
        assert torch.equal(r.noisy_ids[0, 4:], ids[0, 4:])
