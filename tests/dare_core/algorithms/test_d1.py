"""d1: its corruption, its loss by hand, shared masks across policies, the non-trivial ratio."""
import copy

import torch

from algo_helpers import make_algo, run_update
from conftest import make_tiny_llada
from dare_core.batch import Batch
from dare_core.config import RLConfig
from dare_core.diffusion.masking import valid_region

EOS, MASK = 38, 39


def _algo(model, rl=None, **opts):
    return make_algo("d1", model, rl, **opts)


def _rollout_batch(n=6, P=8, L=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30, (n, P + L), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :3] = 0
    ids[0, :3] = EOS
    ids[1, P + 4:] = EOS  # an answer that stops early: EOS tail
    valid = valid_region(ids[:, P:], EOS, attn[:, P:])
    adv = torch.linspace(-1, 1, n)
    return Batch(ids, attn, P, valid, [f"u{i}" for i in range(n)], adv)


def test_corruption_masks_all_response_and_some_prompt():
    model = make_tiny_llada()
    algo = _algo(model, p_mask_prompt=0.15)
    batch = _rollout_batch(n=64, P=40)
    prompt_masked, prompt_real = 0, 0
    for it in range(20):
        c = algo.corrupt(batch, (0, 3, it))
        assert (c.noisy_ids[:, batch.prompt_len:] == MASK).all()
        assert torch.equal(c.scored[:, batch.prompt_len:], batch.response_mask)
        assert not c.scored[:, : batch.prompt_len].any()
        real = batch.attention_mask[:, : batch.prompt_len].bool()
        assert (c.noisy_ids[:, : batch.prompt_len][~real] != MASK).all()  # padding never masked
        prompt_masked += (c.noisy_ids[:, : batch.prompt_len][real] == MASK).sum().item()
        prompt_real += real.sum().item()
    rate, sigma = prompt_masked / prompt_real, (0.15 * 0.85 / prompt_real) ** 0.5
    assert abs(rate - 0.15) < 3 * sigma
    # each inner iteration gets a fresh prompt mask; the same iteration the same one
    assert not torch.equal(algo.corrupt(batch, (0, 3, 0)).noisy_ids, algo.corrupt(batch, (0, 3, 1)).noisy_ids)
    assert torch.equal(algo.corrupt(batch, (0, 3, 1)).noisy_ids, algo.corrupt(batch, (0, 3, 1)).noisy_ids)


def test_loss_by_hand_only_valid_tokens():
    model = make_tiny_llada()
    rl = RLConfig(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0, kl_beta=0.04, kl_estimator="k3")
    algo = _algo(model, rl)
    batch = _rollout_batch()
    c = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        old = algo.score(model, batch, c) - 0.3 * c.scored.float()  # pretend pi_old differs
        ref = algo.score(model, batch, c) + 0.1 * c.scored.float()
    denom = float(c.scored.sum())
    out = run_update(algo, model, batch, c, old, ref, denom, backward=False)
    # by hand
    logits = model(c.noisy_ids, batch.attention_mask).double()
    s = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[..., None]).squeeze(-1)
    total = 0.0
    for b in range(len(batch)):
        for i in range(batch.input_ids.shape[1]):
            if not c.scored[b, i]:
                continue
            a = batch.advantages[b].item()
            r = torch.exp(s[b, i] - old[b, i].double())
            lc = max(-a * r, -a * min(max(r, 0.8), 1.2))
            if a < 0:
                lc = min(lc, -a * 3.0)
            d = s[b, i] - ref[b, i].double()
            total += lc + 0.04 * min(torch.exp(-d) + d - 1, 10.0)
    torch.testing.assert_close(out.loss.double(), total / denom, atol=1e-5, rtol=1e-5)
    assert batch.response_mask[1].sum() == 5  # 4 tokens + the first EOS; the tail is not scored


def _param_grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def _hand_gradient(model, batch, corruption, scored: torch.Tensor, denom: float) -> torch.Tensor:
    """The first update's gradient computed independently: ratio 1 and no KL make the d1 loss
    -sum(A_b * log p(x_bi)) / denom over the scored tokens, log p from a plain forward."""
    model.zero_grad()
    logp = torch.log_softmax(model(corruption.noisy_ids, batch.attention_mask).double(), -1)
    s = logp.gather(-1, batch.input_ids[..., None]).squeeze(-1)
    (-(batch.advantages.double()[:, None] * s * scored).sum() / denom).backward()
    g = _param_grads(model)
    model.zero_grad()
    return g


def test_gradients_only_through_valid_response_scores():
    model = make_tiny_llada()
    algo = _algo(model)
    batch = _rollout_batch()
    P = batch.prompt_len
    c = algo.corrupt(batch, (0, 0, 0))
    denom = float(c.scored.sum())
    run_update(algo, model, batch, c, None, None, denom)
    g_algo = _param_grads(model)
    assert g_algo.abs().sum() > 0
    # against the gradient of the valid tokens only (response up to and including the first EOS)
    valid = torch.zeros_like(c.scored)
    valid[:, P:] = batch.response_mask.bool()
    torch.testing.assert_close(g_algo, _hand_gradient(model, batch, c, valid, denom))
    # were the EOS tail of sample 1 scored too, the gradient would differ: the comparison can tell
    with_tail = valid.clone()
    with_tail[1, P:] = batch.attention_mask[1, P:].bool()
    assert not torch.allclose(g_algo, _hand_gradient(model, batch, c, with_tail, denom))
    # the tail's tokens rewritten (not EOS any more): nothing changes, they are neither targets nor context
    b2 = copy.deepcopy(batch)
    b2.input_ids[1, P + 5:] = (b2.input_ids[1, P + 5:] + 7) % 30
    c2 = algo.corrupt(b2, (0, 0, 0))
    model.zero_grad()
    run_update(algo, model, b2, c2, None, None, denom)
    torch.testing.assert_close(_param_grads(model), g_algo)
    # a sample with zero advantage contributes no gradient
    model.zero_grad()
    only = batch.select(torch.tensor([2]))
    only.advantages[:] = 0
    run_update(algo, model, only, c.select(torch.tensor([2])), None, None, 5.0)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_ratio_is_one_first_update_and_not_second():
    model = make_tiny_llada()
    model.train()
    algo = _algo(model, RLConfig(clip_eps_low=0.2, clip_eps_high=0.2))
    batch = _rollout_batch(n=8)
    corr = [algo.corrupt(batch, (0, 0, it)) for it in range(2)]
    with torch.no_grad():
        old = [algo.score(model, batch, c) for c in corr]  # same masks for old and current
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ratios = []
    for it in range(2):
        opt.zero_grad()
        out = run_update(algo, model, batch, corr[it], old[it], None, float(corr[it].scored.sum()))
        ratios.append((out.metrics["ratio"], out.metrics["clipfrac_hi"] + out.metrics["clipfrac_lo"]))
        opt.step()
    assert abs(ratios[0][0] - 1.0) < 1e-6 and ratios[0][1] == 0.0
    assert abs(ratios[1][0] - 1.0) > 1e-3 and ratios[1][1] > 0.0
