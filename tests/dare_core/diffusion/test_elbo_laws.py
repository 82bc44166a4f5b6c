"""The Bernoulli (1/t) and exact-count (n/l) masking laws estimate the same ELBO (docs/diffusion.md#corruption-laws),
checked against the exact value on a toy model whose per-token loss depends on the masked set."""
import itertools
import math

import torch
from scipy.stats import chisquare

from dare_core.diffusion.masking import bernoulli_mask, count_mask, sample_mask_prob
from dare_core.diffusion.seeding import sample_generators

N = 3


def _toy_ce():
    g = torch.Generator().manual_seed(0)
    return {s: torch.rand(N, generator=g, dtype=torch.float64) * 3 for s in itertools.product([False, True], repeat=N)}


def _exact(ce):
    total = 0.0
    for l in range(1, N + 1):
        subsets = [s for s in ce if sum(s) == l]
        total += sum(ce[s][list(s)].sum().item() for s in subsets) / len(subsets) / l
    return total


def test_both_laws_are_unbiased_for_the_exact_value():
    ce, draws = _toy_ce(), 20000
    exact = _exact(ce)
    maskable = torch.ones(draws, N, dtype=torch.bool)
    gens = sample_generators((0, "elbo"), list(range(draws)))
    p = sample_mask_prob(gens, eps=1e-3)
    masks_b = bernoulli_mask(maskable, p, gens)
    masks_c, p_c = count_mask(maskable, sample_generators((1, "elbo"), list(range(draws))))
    for masks, probs in ((masks_b, p), (masks_c, p_c)):
        vals = torch.stack([ce[tuple(m.tolist())][m].sum() / q for m, q in zip(masks, probs.double())])
        se = vals.std().item() / math.sqrt(draws)
        assert abs(vals.mean().item() - exact) < 4 * se + 2e-3 * exact, (vals.mean().item(), exact, se)
    # the count law's weights are bounded by n; the Bernoulli law's reach 1/eps
    assert (1 / p_c).max() <= N and (1 / p).max() > 10 * N


def test_count_law_counts_are_uniform_and_stay_in_the_maskable_set():
    maskable = torch.zeros(6000, 8, dtype=torch.bool)
    maskable[:, 1:6] = True  # n = 5
    masks, p = count_mask(maskable, sample_generators((2,), list(range(6000))))
    assert not (masks & ~maskable).any()
    counts = masks.sum(-1)
    assert torch.equal(p, counts / 5.0)
    observed = torch.bincount(counts, minlength=6)[1:].numpy()
    assert counts.min() >= 1 and chisquare(observed).pvalue > 1e-3
