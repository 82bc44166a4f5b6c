"""The entropy bonus `rl.entropy_coeff` (docs/algorithms.md#entropy-bonus): the softmax entropy of p_theta(.|z, i)
at the scored tokens, aggregated like the policy term, subtracted from the loss. By hand from the
model's plain forward for every token-level algorithm; its gradient against autograd of a
hand-written reference; global denominators (the micro-batch split changes nothing); a configuration
error for every sequence-level estimator; and entropy_coeff 0 leaves the loss bit-identical."""
import copy
import functools
import math

import pytest
import torch

from algo_helpers import make_algo, run_update
from conftest import make_tiny_llada
from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.common import token_policy_loss
from dare_core.algorithms.registry import RL_ALGORITHMS, build_algorithm, get_rl_algorithm
from dare_core.batch import Batch
from dare_core.config import ConfigError, FieldError, RLConfig, SamplerConfig, from_dict
from dare_core.diffusion import likelihood
from dare_core.diffusion.likelihood import entropy_of_logprobs, token_logprobs
from rl_reference import grads
from rollout_helpers import rollout_batch, sampler_for
from tiny_models import tiny

get_rl_algorithm("d1")  # imports every algorithm module
COEFF = 0.3


# --------------------------------------------------------------------------- references by hand


def plain_logits(model, noisy: torch.Tensor, targets: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """[B, S, V] float64 logits by the model's plain forward, with a graph (block diffusion: one plain
    forward per block over [clean earlier blocks ; the noisy block], as rl_reference.plain_logp)."""
    if model.block_size is None:
        return model(noisy, attn).double()
    rows = []
    bs = model.block_size
    for r in range(noisy.shape[0]):
        cols = attn[r].bool().nonzero().squeeze(-1)
        clean, z = targets[r, cols], noisy[r, cols]
        row = torch.zeros(noisy.shape[1], model.net.lm_head.weight.shape[0], dtype=torch.float64)
        for lo in range(0, cols.numel(), bs):
            hi = min(lo + bs, cols.numel())
            inp = torch.cat([clean[:lo], z[lo:hi]])[None]
            row = row.index_put((cols[lo:hi],), model(inp)[0, lo:hi].double())
        rows.append(row)
    return torch.stack(rows)


def plain_entropy(model, noisy, targets, attn, temperature: float = 1.0, exclude=()) -> torch.Tensor:
    """[B, S] float64 -sum_v p_v log p_v of softmax(f(noisy)/T) (excluded tokens: probability 0)."""
    logits = plain_logits(model, noisy, targets, attn) / temperature
    if len(exclude):
        logits = logits.index_fill(-1, torch.tensor(list(exclude)), -math.inf)
    p = torch.softmax(logits, -1)
    return torch.special.entr(p).sum(-1)


# --------------------------------------------------------------------------- the entropy function


@pytest.mark.parametrize("chunk", [1 << 24, 7])
def test_entropy_of_logprobs_value_and_gradient(monkeypatch, chunk):
    """The memory-lean entropy equals -sum p log p, also with excluded (-inf) tokens, and its
    gradient through log_softmax equals autograd's of the plain formula (chunked or not)."""
    monkeypatch.setattr(likelihood, "ENTROPY_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(9, 11, generator=g, dtype=torch.float64)).requires_grad_(True)
    up = torch.randn(9, generator=g, dtype=torch.float64)
    for exclude in ([], [3, 10]):
        x = logits.index_fill(-1, torch.tensor(exclude, dtype=torch.long), -math.inf) if exclude else logits
        h = entropy_of_logprobs(torch.log_softmax(x, -1))
        (gh,) = torch.autograd.grad((h * up).sum(), logits, retain_graph=True)
        kept = [v for v in range(logits.shape[-1]) if v not in exclude]  # the plain formula over the others
        lp = torch.log_softmax(logits[:, kept], -1)
        want = -(lp.exp() * lp).sum(-1)
        (gw,) = torch.autograd.grad((want * up).sum(), logits)
        torch.testing.assert_close(h, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gh, gw, rtol=1e-10, atol=1e-12)
        assert torch.isfinite(gh).all()
        if exclude:
            assert (gh[:, exclude] == 0).all()
    # a uniform distribution over n tokens has entropy log n
    torch.testing.assert_close(entropy_of_logprobs(torch.log_softmax(torch.zeros(2, 11, dtype=torch.float64), -1)),
                               torch.full((2,), math.log(11), dtype=torch.float64))


# --------------------------------------------------------------------------- d1: value and gradient by hand

EOS, MASK = 38, 39


def _d1_batch(n=6, P=8, L=12, seed=0):
    from dare_core.diffusion.masking import valid_region

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30, (n, P + L), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :3] = 0
    ids[0, :3] = EOS
    ids[1, P + 4:] = EOS  # an answer that stops early: its EOS tail is not scored
    valid = valid_region(ids[:, P:], EOS, attn[:, P:])
    return Batch(ids, attn, P, valid, [f"u{i}" for i in range(n)], torch.linspace(-1, 1, n))


def _d1_setup(coeff):
    model = make_tiny_llada().double()
    rl = RLConfig(kl_beta=0.04, entropy_coeff=coeff)
    algo = make_algo("d1", model, rl, p_mask_prompt=0.15)
    batch = _d1_batch()
    c = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s = algo.score(model, batch, c)
    old = s - 0.3 * c.scored.float()  # pi_old differs: the ratio is not 1
    ref = s + 0.1 * c.scored.float()
    return model, algo, batch, c, old, ref


def test_d1_entropy_term_equals_the_hand_computation():
    """(a) loss(coeff) - loss(0) = -coeff * token-mean of the softmax entropy at the scored positions
    (global denominator: all scored tokens of the mini-batch), and `entropy` is that token mean."""
    losses = {}
    for coeff in (0.0, COEFF):
        model, algo, batch, c, old, ref = _d1_setup(coeff)
        out = run_update(algo, model, batch, c, old, ref, backward=False)
        losses[coeff] = (float(out.loss), out.metrics)
    with torch.no_grad():
        h = plain_entropy(model, c.noisy_ids, batch.input_ids, batch.attention_mask)
    mask = c.scored.double()
    assert mask.sum() > 0 and not c.scored[1, batch.prompt_len + 5:].any()  # the tail is not scored
    token_mean = float((h * mask).sum() / mask.sum())
    assert losses[COEFF][1]["entropy"] == pytest.approx(token_mean, rel=1e-5)
    assert losses[COEFF][0] - losses[0.0][0] == pytest.approx(-COEFF * token_mean, rel=1e-5, abs=1e-7)
    assert "entropy" not in losses[0.0][1]
    # the metric is an entropy: between 0 and log V
    assert 0 < token_mean < math.log(model.net.lm_head.weight.shape[0])


def test_d1_gradient_is_policy_gradient_minus_coeff_times_entropy_gradient():
    """(b) grad(loss with coeff) = grad(loss without) - coeff * grad(token-mean entropy), the last
    by autograd of the hand-written entropy of the plain forward."""
    found = {}
    for coeff in (0.0, COEFF):
        model, algo, batch, c, old, ref = _d1_setup(coeff)
        model.zero_grad()
        run_update(algo, model, batch, c, old, ref)
        found[coeff] = grads(model)
    model.zero_grad()
    mask = c.scored.double()
    h = plain_entropy(model, c.noisy_ids, batch.input_ids, batch.attention_mask)
    ((h * mask).sum() / mask.sum()).backward()
    g_entropy = grads(model)
    diff = found[COEFF] - found[0.0]
    assert diff.norm() > 1e-3 * found[0.0].norm()  # the bonus changes the gradient
    want = found[0.0] - COEFF * g_entropy
    assert float((found[COEFF] - want).norm() / (COEFF * g_entropy).norm()) < 1e-5


# --------------------------------------------------------------------------- every token-level algorithm


def _sampler(name, model) -> SamplerConfig:
    if name == "just_grpo":
        return SamplerConfig(gen_length=8, steps=8, block_length=1, temperature=0.7)
    return sampler_for(model, temperature=0.9)


@functools.lru_cache(maxsize=None)
def _rollout(name, family, n):
    model = tiny(family)
    batch, _ = rollout_batch(model, _sampler(name, model), n=n, prompt_len=6, record="steps",
                             advantages=torch.linspace(-1.2, 1.0, n))
    return batch


def _algo(name, model, coeff, **rl):
    cfg = RLConfig(**{"rows_per_forward": 2, "sampler": _sampler(name, model), "entropy_coeff": coeff, **rl})
    return make_algo(name, model, cfg)


def _hand_term(name, model, algo, batch, cs, denom) -> float:
    """sum over scored tokens of (the algorithm's aggregation weight) * H / normaliser, float64."""
    T = getattr(algo, "temperature", 1.0)
    exclude = (algo.mask_id,) if name in ("cj_grpo", "just_grpo") else ()
    # CJ-GRPO replays over the record's columns (block diffusion: the terminal block whole)
    batch = getattr(algo, "_replayed", lambda b: b)(batch)
    with torch.no_grad():
        if name == "d1":
            h = plain_entropy(model, cs.noisy_ids, batch.input_ids, batch.attention_mask)
            return float((h * cs.scored).sum() / denom[0])
        hs = [plain_entropy(model, r.noisy_ids, r.targets if r.targets is not None else batch.input_ids,
                            batch.attention_mask, T, exclude) for r in cs.rows]
        scored = [r.scored.double() for r in cs.rows]
        if name == "coupled_grpo":  # the mean over the passes that score the token
            per_token = sum(h * m for h, m in zip(hs, scored)) / sum(scored).clamp_min(1)
            return float((per_token * cs.scored).sum() / denom[0])
        if name == "just_grpo":
            return float(sum((h * m).sum() for h, m in zip(hs, scored)) / denom[0])
        if name == "cj_grpo" and model.block_size is None:  # (1/K) sum_k token-mean over step k's tokens
            used = int((denom > 0).sum())
            return float(sum((h * m).sum() / max(float(d), 1.0) for h, m, d in zip(hs, scored, denom)) / used)
        if name == "cj_grpo":  # Eq. 11 weights over the number of sequences
            w = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
            w[:, batch.prompt_len:] = cs.info["weight"].double()
            return float(sum((h * m * w).sum() for h, m in zip(hs, scored)) / denom[0])
    raise AssertionError(name)


TOKEN_CASES = [("d1", "llada"), ("d1", "sdar"), ("coupled_grpo", "Dream"), ("coupled_grpo", "sdar"), ("cj_grpo", "llada"),
               ("cj_grpo", "sdar"), ("just_grpo", "llada")]


@pytest.mark.parametrize("name,family", TOKEN_CASES)
def test_entropy_term_by_hand_for_every_token_level_algorithm(name, family):
    """loss(coeff) - loss(0) = -coeff * the hand aggregation of the entropy, at the estimator's own
    temperature (MASK excluded for trajectory scores); the gradient moves, linearly in coeff."""
    model = tiny(family).double()
    batch = copy.deepcopy(_rollout(name, family, 4))
    results = {}
    for coeff in (0.0, COEFF, 2 * COEFF):
        algo = _algo(name, model, coeff, kl_beta=0.02)
        cs = algo.corrupt(batch, (0, 0, 0))
        with torch.no_grad():
            s = algo.score(model, batch, cs)
        model.zero_grad()
        out = run_update(algo, model, batch, cs, s - 0.2, s + 0.1)
        results[coeff] = (float(out.loss), grads(model), out.metrics)
    term = _hand_term(name, model, algo, batch, cs, algo.denominator(batch, cs))
    assert term > 0
    assert results[COEFF][0] - results[0.0][0] == pytest.approx(-COEFF * term, rel=1e-5, abs=1e-8)
    assert results[COEFF][2]["entropy"] > 0 and "entropy" not in results[0.0][2]
    d1, d2 = results[COEFF][1] - results[0.0][1], results[2 * COEFF][1] - results[0.0][1]
    assert d1.norm() > 1e-4 * results[0.0][1].norm()
    assert float((d2 - 2 * d1).norm() / d2.norm()) < 1e-4


@pytest.mark.parametrize("name,family", [("d1", "llada"), ("coupled_grpo", "Dream"), ("cj_grpo", "llada"), ("cj_grpo", "sdar"),
                                         ("just_grpo", "llada")])
def test_entropy_gradient_independent_of_the_micro_batch_split(name, family):
    """The entropy is normalised by the same global denominators: micro-batches of 1, 2 and 8
    accumulate the full-batch gradient."""
    model = tiny(family).double()
    algo = _algo(name, model, COEFF)
    batch = copy.deepcopy(_rollout(name, family, 8))
    cs = algo.corrupt(batch, (0, 0, 0))
    denom = algo.denominator(batch, cs)
    found = []
    for size in (8, 1, 2):
        model.zero_grad()
        total = 0.0
        for mc in torch.arange(8).split(size):
            total += float(run_update(algo, model, batch.select(mc), cs.select(mc), None, None, denom).loss)
        found.append((total, grads(model)))
    for total, g in found[1:]:
        assert total == pytest.approx(found[0][0], rel=1e-5, abs=1e-8)
        assert float((g - found[0][1]).norm() / found[0][1].norm()) < 1e-5


def test_mdpo_entropy_term_by_hand():
    """MDPO: the entropy joins the KL in the step term, weighted by c_t 1[M_t] / |M_t| and averaged
    over the selected steps."""
    from dare_core.sampling.params import SamplingParams

    model = make_tiny_llada().double()
    g = torch.Generator().manual_seed(0)
    n, P, L, K = 4, 3, 5, 3
    ids = torch.randint(0, 30, (n, P + L), generator=g)
    records = {"step_map": torch.tensor([[1, 1, 2, 3, 3]] * n, dtype=torch.int32), "decoded": ids[:, P:].clone(),
               "x0_hat": torch.randint(0, 30, (n, K, L), generator=g).int(), "confidence": torch.rand(n, K, L, generator=g),
               "step_adv": torch.tensor([[0.5, 0.1], [-1.0, 0.3], [1.5, -0.2], [0.2, 0.9]]),
               "steps_chosen": torch.tensor([[0, 2]] * n)}
    batch = Batch(ids, torch.ones_like(ids), P, torch.ones(n, L, dtype=torch.bool), [f"u{i}" for i in range(n)], torch.zeros(n), records)
    losses = {}
    for coeff in (0.0, COEFF):
        rl = RLConfig(group_size=2, entropy_coeff=coeff, sampler=SamplingParams(gen_length=5, steps=3, block_length=5, temperature=0.8))
        algo = make_algo("mdpo", model, rl, sample_train_steps=2)
        cs = algo.corrupt(batch, (0, 0, 0))
        out = run_update(algo, model, batch, cs, None, None, backward=False)
        losses[coeff] = (float(out.loss), out.metrics)
    denom = algo.denominator(batch, cs)
    term = 0.0
    with torch.no_grad():
        for j, row in enumerate(cs.rows):
            h = plain_entropy(model, row.noisy_ids, row.targets, batch.attention_mask, 0.8)
            conf = torch.zeros_like(h)
            conf[:, P:] = cs.info["confidence"][:, j].double()
            term += float((h * conf * row.scored).sum() / denom[j]) / len(cs.rows)
    assert term > 0 and "entropy" in losses[COEFF][1]
    assert losses[COEFF][0] - losses[0.0][0] == pytest.approx(-COEFF * term, rel=1e-5, abs=1e-8)


def test_d_tree_rpo_entropy_term_by_hand():
    """d-TreeRPO: the entropy of the parent state's distribution at each transition's active tokens,
    token mean per transition, mean over the transitions (like the policy term)."""
    from dare_core.sampling.tree import TreeOutput, tree_shape

    model = make_tiny_llada().double()
    shape = tree_shape(4, 2, 3, 2)
    M = MASK
    level1 = [[5, M, M, M], [M, 6, M, M], [5, M, M, M]]
    leaves = [[[5, 1, 2, 3], [5, 1, 4, 3]], [[8, 6, M, 2], [8, 6, 9, 9]], [[5, 2, 2, 2], [5, 7, 1, 1]]]
    states = torch.full((shape.num_nodes, 4), M)
    for i, node in enumerate(shape.children(0)):
        states[node] = torch.tensor(level1[i])
        for k, leaf in zip(shape.children(node), leaves[i]):
            states[k] = torch.tensor(leaf)
    states = states.expand(2, -1, -1).clone()
    tree = TreeOutput(shape, states, states[:, shape.leaves], 0, torch.zeros(2, 6))
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.25, 0.75]])
    sampler = SamplerConfig(gen_length=8, steps=4, block_length=8, temperature=1.0, stop_at_eos=False, batch_size=7)
    losses = {}
    for coeff in (0.0, COEFF):
        rl = RLConfig(group_size=6, sampler=sampler, entropy_coeff=coeff)
        algo = make_algo("d_tree_rpo", model, rl, num_tree_samples=3, branch_factor=2, score_temperature=1.5)
        batch, _ = algo.transition_batch(tree, [[1, 2, 3], [4, 5]], ["u0", "u1"], rewards, 0.6, pad_id=EOS)
        cs = algo.corrupt(batch, (0, 0, 0))
        out = run_update(algo, model, batch, cs, None, None, backward=False)
        losses[coeff] = (float(out.loss), out.metrics)
    denom = algo.denominator(batch, cs)
    with torch.no_grad():
        h = plain_entropy(model, cs.noisy_ids, batch.input_ids, batch.attention_mask, 1.5)
    active = cs.scored.double()
    term = float(((h * active).sum(-1) / active.sum(-1).clamp_min(1)).sum() / denom[0])
    assert term > 0
    assert losses[COEFF][1]["entropy"] == pytest.approx(float((h * active).sum() / active.sum()), rel=1e-5)
    assert losses[COEFF][0] - losses[0.0][0] == pytest.approx(-COEFF * term, rel=1e-5, abs=1e-8)


# --------------------------------------------------------------------------- sequence-level estimators refuse it


def test_token_level_flags():
    """The estimators that score whole sequences are exactly the ELBO ones."""
    rl_algos = {n: c for n, c in RL_ALGORITHMS.items() if isinstance(c, type) and issubclass(c, RLAlgorithm)}
    assert {n for n, c in rl_algos.items() if not c.token_level} == {"spg", "bgpo", "espo", "ebpo"}


@pytest.mark.parametrize("name,family", [("spg", "llada"), ("bgpo", "llada"), ("bgpo", "sdar"), ("espo", "llada"), ("ebpo", "sdar")])
def test_sequence_level_algorithm_with_entropy_coeff_is_a_configuration_error(name, family):
    """(c) Raised when the algorithm is built (the RL stage builds it in its checks, before DeepSpeed)."""
    model = tiny(family)
    rl = RLConfig(algorithm=name, entropy_coeff=0.01, sampler=sampler_for(model))
    with pytest.raises(ValueError, match=rf"rl.entropy_coeff = 0.01: rl.algorithm '{name}' is a sequence-level estimator.*d1"):
        build_algorithm(rl, model)
    build_algorithm(RLConfig(algorithm=name, sampler=sampler_for(model)), model)  # entropy_coeff 0: fine


def test_entropy_coeff_must_not_be_negative():
    with pytest.raises(FieldError, match="entropy_coeff must be >= 0"):
        RLConfig(entropy_coeff=-0.1)
    with pytest.raises(ConfigError, match="rl.entropy_coeff"):
        from_dict(RLConfig, {"entropy_coeff": -0.1}, "rl")


# --------------------------------------------------------------------------- coefficient 0: nothing changes


@pytest.mark.parametrize("name,family", TOKEN_CASES)
def test_zero_coefficient_computes_no_entropy_and_keeps_the_loss(monkeypatch, name, family):
    """(d) With entropy_coeff 0 the entropy is never computed (the default scoring path), no metric
    is logged, and the loss and gradient are bit-identical to those of a config without the key."""
    model = tiny(family)
    batch = copy.deepcopy(_rollout(name, family, 4))

    def forbidden(*a, **k):
        raise AssertionError("entropy computed with entropy_coeff 0")

    monkeypatch.setattr(likelihood._Entropy, "apply", forbidden)
    found = []
    for cfg in (RLConfig(rows_per_forward=2, sampler=_sampler(name, model), kl_beta=0.02),
                RLConfig(rows_per_forward=2, sampler=_sampler(name, model), kl_beta=0.02, entropy_coeff=0.0)):
        algo = make_algo(name, model, cfg)
        cs = algo.corrupt(batch, (0, 0, 0))
        with torch.no_grad():
            s = algo.score(model, batch, cs)
        model.zero_grad()
        out = run_update(algo, model, batch, cs, s - 0.2, s + 0.1)
        assert "entropy" not in out.metrics
        found.append((out.loss, grads(model)))
    assert torch.equal(torch.as_tensor(found[0][0]), torch.as_tensor(found[1][0])) and torch.equal(found[0][1], found[1][1])


def test_zero_coefficient_d1_loss_is_the_plain_token_policy_loss():
    """(d) d1 with entropy_coeff 0 is exactly (bit for bit) token_policy_loss of the plain scores."""
    model, algo, batch, c, old, ref = _d1_setup(0.0)
    out = run_update(algo, model, batch, c, old, ref, backward=False)
    s = token_logprobs(model, c, batch.input_ids, batch.attention_mask)
    want, _ = token_policy_loss(s, old, ref, batch.advantages[:, None].to(s), c.scored.float(), float(c.scored.sum()), algo.rl)
    assert torch.equal(out.loss, want.detach())
