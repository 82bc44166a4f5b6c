"""The forward process: completion-only, seeded per sample, isolated from global RNGs."""
import random

import torch

from dare_core.diffusion.masking import (bernoulli_mask, full_response_corruption, response_corruption,
                                         sample_mask_prob, valid_region)
from dare_core.diffusion.seeding import derive_seed, sample_generators

MASK, EOS, PAD = 99, 98, 98


def _batch(b=4, p=6, l=10):
    ids = torch.randint(0, 90, (b, p + l))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # left padding of sample 0
    ids[0, :3] = PAD
    return ids, attn, p


def test_prompt_and_padding_never_masked_and_rate_matches_p():
    ids, attn, P = _batch(b=1, l=64)
    total, hits = 0, 0
    for draw in range(2000):
        gens = sample_generators((0, draw, "t"), ["a"])
        p = torch.tensor([0.3])
        c = response_corruption(ids, P, torch.ones(1, 64, dtype=torch.bool), MASK, p, gens)
        assert not c.scored[:, :P].any()
        assert torch.equal(c.noisy_ids[:, :P], ids[:, :P])
        assert torch.equal(c.noisy_ids == MASK, c.scored)
        hits += c.scored.sum().item()
        total += 64
    rate, sigma = hits / total, (0.3 * 0.7 / total) ** 0.5
    assert abs(rate - 0.3) < 3 * sigma


def test_masks_only_inside_the_maskable_set():
    maskable = torch.zeros(3, 12, dtype=torch.bool)
    maskable[:, 2:7] = True
    for draw in range(200):
        m = bernoulli_mask(maskable, torch.ones(3) * 0.9, sample_generators((draw,), ["x", "y", "z"]))
        assert not (m & ~maskable).any()


def test_same_seed_same_mask_and_batch_invariance():
    ids, attn, P = _batch()
    uids = ["s0", "s1", "s2", "s3"]
    full = response_corruption(ids, P, torch.ones(4, 10, dtype=torch.bool), MASK, torch.full((4,), 0.5), sample_generators((1, 2), uids))
    again = response_corruption(ids, P, torch.ones(4, 10, dtype=torch.bool), MASK, torch.full((4,), 0.5), sample_generators((1, 2), uids))
    assert torch.equal(full.noisy_ids, again.noisy_ids)
    # sample 2 alone gets exactly its mask from the batch
    alone = response_corruption(ids[2:3], P, torch.ones(1, 10, dtype=torch.bool), MASK, torch.full((1,), 0.5), sample_generators((1, 2), uids[2:3]))
    assert torch.equal(alone.scored[0], full.scored[2])
    # another step gives another mask
    other = response_corruption(ids, P, torch.ones(4, 10, dtype=torch.bool), MASK, torch.full((4,), 0.5), sample_generators((1, 3), uids))
    assert not torch.equal(other.scored, full.scored)


def test_no_global_rng_is_touched():
    ids, attn, P = _batch()
    torch_state, py_state = torch.random.get_rng_state(), random.getstate()
    gens = sample_generators((0, 0), list("abcd"))
    sample_mask_prob(gens)
    full_response_corruption(ids, attn, P, valid_region(ids[:, P:], EOS), MASK, 0.15, gens)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert random.getstate() == py_state


def test_mask_prob_is_uniform_on_eps_one():
    p = torch.stack([sample_mask_prob(sample_generators((i,), ["u"]))[0] for i in range(4000)])
    assert p.min() >= 1e-3 and p.max() <= 1
    from scipy.stats import kstest

    assert kstest(((p - 1e-3) / (1 - 1e-3)).numpy(), "uniform").pvalue > 1e-3


def test_valid_region_includes_first_eos_only():
    resp = torch.tensor([[5, 6, EOS, EOS, EOS], [5, 6, 7, 8, 9], [EOS, EOS, EOS, EOS, EOS]])
    v = valid_region(resp, EOS)
    assert v.tolist() == [[True, True, True, False, False], [True] * 5, [True, False, False, False, False]]


def test_derived_seeds_differ_by_every_part():
    base = derive_seed(0, 1, "u", 0, 0, "coupled")
    assert len({base, derive_seed(1, 1, "u", 0, 0, "coupled"), derive_seed(0, 2, "u", 0, 0, "coupled"),
                derive_seed(0, 1, "v", 0, 0, "coupled"), derive_seed(0, 1, "u", 1, 0, "coupled"),
                derive_seed(0, 1, "u", 0, 0, "d1")}) == 6
