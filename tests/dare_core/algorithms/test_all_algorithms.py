"""Every registered RL algorithm on real tiny rollouts (docs/diffusion.md#seeding, docs/algorithms.md#rl-shared, docs/algorithms.md#rl-algorithms as a whole):
one update per supported family with a finite loss and gradients, a clear error on the others;
corruptions shared, reproducible, batch- and padding-invariant and isolated from global RNGs; no
gradient from zero advantages, the EOS tail or padding; a ratio that moves on the second inner
update; the same gradient for every micro-batch split."""
import copy
import functools
import random

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.registry import RL_ALGORITHMS, get_rl_algorithm
from dare_core.config import RLConfig, SamplerConfig
from dare_core.diffusion.masking import valid_region
from rl_reference import grads
from rollout_helpers import rollout_batch, sampler_for
from tiny_models import tiny

get_rl_algorithm("d1")  # imports every algorithm module
# covered elsewhere: SFT is not RL; MDPO and d-TreeRPO need their own rollout records
SKIP = {"sft", "mdpo", "d_tree_rpo"}
RL_ALGOS = sorted(n for n, c in RL_ALGORITHMS.items()
                  if isinstance(c, type) and issubclass(c, RLAlgorithm) and n not in SKIP and c.requires <= {"step_map", "decoded"})
FAMILIES = {"llada": "masked", "Dream": "masked", "sdar": "block", "diffusion_gemma": "uniform"}
RATIO_ALGOS = ["d1", "coupled_grpo", "bgpo", "espo", "ebpo", "cj_grpo", "just_grpo"]
SMALL = {"bgpo": {"mc_num": 3}, "ebpo": {"mc_num": 3}, "espo": {"mc_num": 2}, "spg": {"num_t": 2}}
EOS = 62


def test_the_expected_algorithms_are_registered():
    assert set(RATIO_ALGOS) | {"spg"} <= set(RL_ALGOS)


def _sampler(name, model) -> SamplerConfig:
    if name == "just_grpo":
        return SamplerConfig(gen_length=8, steps=8, block_length=1, temperature=0.7)
    return sampler_for(model, temperature=0.9)


def _algo(name, model, **rl):
    cfg = RLConfig(**{"rows_per_forward": 2, "sampler": _sampler(name, model), **rl})
    return make_algo(name, model, cfg, **SMALL.get(name, {}))


@functools.lru_cache(maxsize=None)
def _rollout(family, n):
    model = tiny(family)
    batch, _ = rollout_batch(model, sampler_for(model), n=n, prompt_len=6, record="steps", advantages=torch.linspace(-1.2, 1.0, n))
    return batch


def _batch(family, n=4):
    return copy.deepcopy(_rollout(family, n))


def _supported(name, family):
    return FAMILIES[family] in get_rl_algorithm(name).families


CASES = [(n, f) for n in RL_ALGOS for f in FAMILIES]
SUPPORTED = [c for c in CASES if _supported(*c)]


@pytest.mark.parametrize("name,family", CASES)
def test_one_update_per_family(name, family):
    model = tiny(family)
    if not _supported(name, family):
        with pytest.raises(ValueError, match="not defined for"):
            _algo(name, model)
        return
    algo = _algo(name, model)
    batch = _batch(family)
    cs = algo.corrupt(batch, (0, 0, 0))
    out = run_update(algo, model, batch, cs)
    assert torch.isfinite(torch.as_tensor(out.loss)).all()
    g = grads(model)
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    assert all(isinstance(v, float) for v in out.metrics.values())


@pytest.mark.parametrize("name,family", SUPPORTED)
def test_corruptions_shared_reproducible_invariant_isolated(name, family):
    model = tiny(family)
    algo = _algo(name, model, kl_beta=0.0 if name == "spg" else 0.01)
    batch = _batch(family)
    torch_state, py_state = torch.random.get_rng_state(), random.getstate()
    one, two = algo.corrupt(batch, (0, 3, 1)), algo.corrupt(batch, (0, 3, 1))
    with torch.no_grad():
        s1, s2 = algo.score(model, batch, one), algo.score(model, batch, two)
    run_update(algo, model, batch, one)
    assert torch.equal(torch.random.get_rng_state(), torch_state) and random.getstate() == py_state
    assert torch.equal(s1, s2)
    rows = lambda c: c.rows if hasattr(c, "rows") else [c]  # noqa: E731
    for a, b in zip(rows(one), rows(two)):
        assert torch.equal(a.noisy_ids, b.noisy_ids) and torch.equal(a.scored, b.scored)
    if name not in ("cj_grpo", "just_grpo"):  # trajectory corruptions draw nothing
        other = algo.corrupt(batch, (0, 4, 1))
        assert any(not torch.equal(a.noisy_ids, b.noisy_ids) for a, b in zip(rows(one), rows(other)))
    # a sample's corruption does not depend on its neighbours: alone = selected from the batch
    idx = torch.tensor([2, 0])
    alone = algo.corrupt(batch.select(idx), (0, 3, 1))
    for a, b in zip(rows(one.select(idx)), rows(alone)):
        assert torch.equal(a.noisy_ids, b.noisy_ids) and torch.equal(a.scored, b.scored)
    # nor on how much left padding the batch gave its prompt
    wider = copy.deepcopy(batch)
    wider.input_ids = torch.cat([torch.full((len(batch), 2), model.pad_token_id), batch.input_ids], 1)
    wider.attention_mask = torch.cat([torch.zeros(len(batch), 2, dtype=batch.attention_mask.dtype), batch.attention_mask], 1)
    wider.prompt_len += 2
    padded = algo.corrupt(wider, (0, 3, 1))
    for a, b in zip(rows(one), rows(padded)):
        assert torch.equal(a.noisy_ids, b.noisy_ids[:, 2:]) and torch.equal(a.scored, b.scored[:, 2:])


@pytest.mark.parametrize("name,family", SUPPORTED)
def test_zero_advantage_gives_zero_gradient(name, family):
    model = tiny(family)
    algo = _algo(name, model)
    batch = _batch(family)
    batch.advantages = torch.zeros(len(batch))
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        old = algo.score(model, batch, cs) if name != "spg" else None
    run_update(algo, model, batch, cs, old)
    assert grads(model).abs().max() == 0


def _with_tail(batch, cut=(3, 5)):
    """Answers that stop early: EOS from `cut[b]` on for the first samples, V recomputed."""
    P = batch.prompt_len
    for b, c in enumerate(cut):
        batch.input_ids[b, P + c:] = EOS
    batch.response_mask = valid_region(batch.input_ids[:, P:], EOS, batch.attention_mask[:, P:])
    return batch


@pytest.mark.parametrize("name,family", [c for c in SUPPORTED if c[0] != "cj_grpo"])
def test_tail_and_padding_tokens_change_nothing(name, family):
    """Under tail_policy mask the tail is MASK in every corrupted input (JustGRPO: MASK from t on),
    and padding is never attended: rewriting either changes neither the loss nor the gradient."""
    model = tiny(family)
    algo = _algo(name, model, kl_beta=0.0)
    batch = _with_tail(_batch(family))
    P = batch.prompt_len
    other = copy.deepcopy(batch)
    g = torch.Generator().manual_seed(5)
    tail = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    tail[:, P:] = ~batch.response_mask
    tail[:, P:] &= (torch.arange(8) > 0)  # keep the first EOS: it is inside V
    first_eos = batch.response_mask & (batch.input_ids[:, P:] == EOS)
    tail[:, P:] &= ~first_eos
    pad = batch.attention_mask == 0
    assert tail.any() and pad.any()
    other.input_ids = torch.where(tail | pad, torch.randint(0, 60, batch.input_ids.shape, generator=g), batch.input_ids)
    results = []
    for b in (batch, other):
        model.zero_grad()
        cs = algo.corrupt(b, (0, 0, 0))
        out = run_update(algo, model, b, cs)
        results.append((float(out.loss), grads(model)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6, abs=1e-8)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", RATIO_ALGOS)
def test_second_inner_update_moves_the_ratio(name):
    family = "sdar" if name == "ebpo" else "llada"
    model = tiny(family)
    model.train()
    algo = _algo(name, model, clip_eps_low=0.2, clip_eps_high=0.2)
    batch = _batch(family, n=6)
    corr = [algo.corrupt(batch, (0, 0, it)) for it in range(2)]
    with torch.no_grad():
        old = [algo.score(model, batch, c) for c in corr]
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    seen = []
    for it in range(2):
        opt.zero_grad()
        out = run_update(algo, model, batch, corr[it], old[it])
        seen.append((out.metrics["ratio"], out.metrics["clipfrac_hi"] + out.metrics["clipfrac_lo"]))
        opt.step()
    assert seen[0][0] == pytest.approx(1.0, abs=1e-5) and seen[0][1] == 0
    assert abs(seen[1][0] - 1.0) > 1e-3 and seen[1][1] > 0


@pytest.mark.parametrize("name", RATIO_ALGOS)
def test_ratio_max_is_the_largest_ratio_whatever_the_row_chunks(name):
    """Each ratio algorithm logs its largest importance ratio, the same whether its rows are scored
    in one chunk or one at a time (chunks combine `*_max` metrics by max, not by a sum of shares)."""
    family = "sdar" if name == "ebpo" else "llada"
    model = tiny(family).double()
    batch = _batch(family, n=6)
    found = []
    for rows in (1, 64):
        algo = _algo(name, model, rows_per_forward=rows)
        cs = algo.corrupt(batch, (0, 0, 0))
        with torch.no_grad():
            s = algo.score(model, batch, cs)
        old = s - 0.5 * torch.randn(s.shape, generator=torch.Generator().manual_seed(0), dtype=s.dtype)
        found.append(run_update(algo, model, batch, cs, old).metrics)
    assert found[0]["ratio_max"] == pytest.approx(found[1]["ratio_max"], rel=1e-9)
    assert found[0]["ratio_max"] > found[0]["ratio"] + 0.01  # spread ratios: the max is not the mean


@pytest.mark.parametrize("name,family", [("d1", "llada"), ("coupled_grpo", "Dream"), ("cj_grpo", "llada"), ("cj_grpo", "sdar"),
                                         ("bgpo", "llada"), ("bgpo", "sdar"), ("espo", "llada"), ("spg", "llada"),
                                         ("just_grpo", "llada"), ("ebpo", "sdar")])
def test_gradient_independent_of_the_micro_batch_split(name, family):
    """Normalisers summed over the mini-batch first (as the loop does): micro-batches of 1, 2 and 8
    accumulate the full-batch gradient."""
    model = tiny(family).double()
    algo = _algo(name, model, kl_beta=0.0 if name == "spg" else 0.05, kl_estimator="k3")
    batch = _batch(family, n=8)
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s = algo.score(model, batch, cs)
    noise = torch.randn(s.shape, generator=torch.Generator().manual_seed(0), dtype=s.dtype)
    old = None if name == "spg" else s + 0.3 * noise
    ref = None if name == "spg" else s - 0.2 * noise
    denom = algo.denominator(batch, cs)
    found = []
    for size in (8, 1, 2):
        model.zero_grad()
        total = 0.0
        for mc in torch.arange(8).split(size):
            out = run_update(algo, model, batch.select(mc), cs.select(mc), None if old is None else old[mc],
                             None if ref is None else ref[mc], denom)
            total += float(out.loss)
        found.append((total, grads(model)))
    full = found[0][1]
    for total, g in found[1:]:
        assert total == pytest.approx(found[0][0], rel=1e-5, abs=1e-8)
        assert float((g - full).norm() / full.norm()) < 1e-5
