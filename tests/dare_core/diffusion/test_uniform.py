"""DiffusionGemma's SFT loss (dare_core/diffusion/uniform.py) on a tiny random net: the canvas
layout, the corruption's law, the draws, and the loss and its gradient equal to a hand computation
from the reference-checked canvas logits (the decoder over prompt + clean earlier canvases, with
the first pass's detached logits as self-conditioning where the coin says so) plus the encoder's
next-token cross-entropy."""
import copy

import torch
import torch.nn.functional as F

from dare_core.diffusion.seeding import generator, sample_generators
from dare_core.diffusion.uniform import canvas_batch, canvas_sft_loss, draw, uniform_corrupt
from dare_core.models.diffusion_gemma import DiffusionGemmaNet, config_from_hf, tiny_config

V, C, EOS, PAD = 64, 4, 1, 0


def _net(seed: int = 0) -> DiffusionGemmaNet:
    torch.manual_seed(seed)
    net = DiffusionGemmaNet(config_from_hf(tiny_config(V, eos_token_id=EOS, canvas_length=C))).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, dtype=p.dtype) + (1.0 if p.dim() == 1 else 0.0))
        for layer in net.layers:
            layer.clean_scalar.fill_(0.9)
            layer.noisy_scalar.fill_(1.1)
    return net


def test_responses_fill_their_last_canvas_with_eos_and_pad_after():
    batch = canvas_batch([[5, 6], [7]], [[10, 11, 12, 13, 14], [20]], C, EOS, PAD)
    assert batch.prompt_len == 2 and batch.n_canvases == 2
    assert batch.ids.tolist() == [[5, 6, 10, 11, 12, 13, 14, EOS, EOS, EOS], [PAD, 7, 20, EOS, EOS, EOS, PAD, PAD, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1] * 10, [0, 1, 1, 1, 1, 1, 0, 0, 0, 0]]
    # a response of exactly one canvas still ends with a canvas of EOS: the model learns to stop
    assert canvas_batch([[5]], [[10, 11, 12, 13]], C, EOS, PAD).ids[0, 5:].tolist() == [EOS] * 4


def test_the_corruption_replaces_each_token_with_probability_t_by_a_uniform_id():
    x0 = torch.full((2, 20000), 3)
    t = torch.tensor([0.25, 0.8])
    out = uniform_corrupt(x0, t, V, sample_generators((0, "law"), ["a", "b"]))
    changed = (out != x0).float().mean(-1)
    expected = t * (1 - 1 / V)  # a replacement may draw the token itself
    assert torch.allclose(changed, expected, atol=0.012), changed
    counts = torch.bincount(out[1][out[1] != 3], minlength=V).float()
    assert counts[3] == 0 and (counts.sum() - counts[3]) > 0
    assert counts[counts > 0].std() / counts[counts > 0].mean() < 0.15  # the other ids about equally often
    again = uniform_corrupt(x0, t, V, sample_generators((0, "law"), ["a", "b"]))
    assert torch.equal(out, again)


def test_draws_score_only_canvases_that_hold_tokens():
    batch = canvas_batch([[5, 6], [7, 8]], [[10] * 9, [20]], C, EOS, PAD)  # 3 canvases; row 1 has one
    for seed in range(20):
        d = draw(batch, V, sample_generators((seed, "draw"), ["a", "b"]), 0.5)
        assert 0 <= int(d.canvas[0]) < 3 and int(d.canvas[1]) == 0
        assert ((1e-4 <= d.t) & (d.t <= 1 - 1e-4)).all()


def _hand_loss(net, batch, d):
    """The decoder over prompt + the clean canvases before the scored one (the reference-checked
    path), the first pass detached, plus the encoder's causal next-token loss."""
    p, total = batch.prompt_len, []
    for b in range(batch.ids.shape[0]):
        k = int(d.canvas[b])
        real = batch.attention_mask[b].bool()
        context = batch.ids[b, :p + k * C][real[:p + k * C]][None]
        x0 = batch.ids[b, p + k * C:p + (k + 1) * C]
        valid = batch.attention_mask[b, p + k * C:p + (k + 1) * C].bool()
        noisy = d.noisy[b][None]
        with torch.no_grad():
            first = net.canvas_logits(context, noisy)
        logits = net.canvas_logits(context, noisy, first if bool(d.use_previous[b]) else None)[0]
        dec = F.cross_entropy(logits[valid], x0[valid])
        seq = batch.ids[b][real][None]
        n = seq.shape[1]
        clean_logits = net.logits(net(seq, torch.ones_like(seq, dtype=torch.bool), torch.arange(n)[None],
                                      torch.zeros_like(seq)))[0]
        enc = F.cross_entropy(clean_logits[:-1], seq[0, 1:])
        total.append(dec + enc)
    return torch.stack(total).mean()


def test_the_loss_and_its_gradient_by_hand():
    batch = canvas_batch([[5, 6, 7], [8]], [[10, 11, 12, 13, 14, 15], [20, 21]], C, EOS, PAD)
    net, twin = _net(), None
    twin = copy.deepcopy(net)
    found = set()
    for seed in range(6):  # until both coins and more than one canvas have come up
        d = draw(batch, V, sample_generators((seed, "sft"), ["a", "b"]), 0.5)
        found |= {(bool(c), int(k)) for c, k in zip(d.use_previous, d.canvas)}
        net.zero_grad()
        twin.zero_grad()
        loss, metrics = canvas_sft_loss(net, batch, d)
        hand = _hand_loss(twin, batch, d)
        torch.testing.assert_close(loss, hand, rtol=1e-6, atol=0)
        loss.backward()
        hand.backward()
        for (name, a), b in zip(net.named_parameters(), twin.parameters()):
            ga = a.grad if a.grad is not None else torch.zeros_like(a)
            gb = b.grad if b.grad is not None else torch.zeros_like(b)
            # (norms and the router compute in float32 inside the float64 net, in other shapes in the two)
            torch.testing.assert_close(ga, gb, rtol=0, atol=1e-5 * max(float(gb.abs().max()), 1e-3), msg=name)
        assert 0 <= metrics["noise/replaced"] <= 1
    assert {c for c, _ in found} == {True, False} and len({k for _, k in found}) > 1


def test_later_canvases_do_not_reach_the_decoder_loss():
    batch = canvas_batch([[5, 6]], [[10, 11, 12, 13, 14, 15, 16, 17, 18]], C, EOS, PAD)  # canvases 0-2
    g = generator(3, "later")
    d = draw(batch, V, [g], 1.0)
    d.canvas[0] = 0
    net = _net()
    changed = canvas_batch([[5, 6]], [[10, 11, 12, 13, 40, 41, 42, 43, 44]], C, EOS, PAD)
    with torch.no_grad():
        a = canvas_sft_loss(net, batch, d)[1]
        b = canvas_sft_loss(net, changed, d)[1]
    assert a["loss/decoder"] == b["loss/decoder"] and a["loss/encoder"] != b["loss/encoder"]


# --------------------------------------------------------------------------- the ELBO for RL


def _posterior(zt: int, x: torch.Tensor, t: float, s: float, k: int) -> torch.Tensor:
    """q(z_s | z_t, x) of uniform-state diffusion (alpha = 1 - t), x a distribution over k ids."""
    a_ts = (1 - t) / (1 - s)
    trans = a_ts * F.one_hot(torch.tensor(zt), k).double() + (1 - a_ts) / k
    post = trans * ((1 - s) * x + s / k)
    return post / post.sum()


def test_the_elbo_integrand_is_the_limit_of_the_step_kl():
    """KL(q(z_s | z_t, x) || q(z_s | z_t, p)) / (t - s) -> the closed form as s -> t."""
    from dare_core.diffusion.uniform import uniform_nelbo_rate

    k, g = 7, generator(0, "elbo-kl")
    for _ in range(6):
        logits = 2 * torch.randn(k, generator=g, dtype=torch.float64)
        x, zt = int(torch.randint(k, (), generator=g)), int(torch.randint(k, (), generator=g))
        t, d = 0.2 + 0.6 * float(torch.rand((), generator=g)), 1e-7
        q = _posterior(zt, F.one_hot(torch.tensor(x), k).double(), t, t - d, k)
        m = _posterior(zt, logits.softmax(-1), t, t - d, k)
        limit = float((q * (q.log() - m.log())).sum()) / d
        rate = float(uniform_nelbo_rate(logits[None], torch.tensor([zt]), torch.tensor([x]), torch.tensor([t])))
        assert abs(rate - limit) <= 1e-4 * limit, (rate, limit)
    sure = torch.full((1, k), -1e4, dtype=torch.float64)
    sure[0, 3] = 1e4
    assert abs(float(uniform_nelbo_rate(sure, torch.tensor([5]), torch.tensor([3]), torch.tensor([0.5])))) < 1e-9


def test_the_monte_carlo_elbo_is_unbiased_on_a_toy():
    """A toy predictor over 2 tokens of a 4-id vocabulary, each position's logits depending on both
    noisy tokens: the exact negative ELBO (every z_t enumerated, t by a fine midpoint rule) against
    the mean of many independent estimates."""
    from dare_core.diffusion.uniform import uniform_nelbo, uniform_nelbo_rate

    k, eps = 4, 1e-4
    g = generator(1, "elbo-toy")
    own, other = 1.5 * torch.randn(2, k, k, generator=g, dtype=torch.float64), torch.randn(2, k, k, generator=g, dtype=torch.float64)

    def predict(noisy):
        return torch.stack([own[0][noisy[:, 0]] + other[0][noisy[:, 1]], own[1][noisy[:, 1]] + other[1][noisy[:, 0]]], dim=1)

    x = torch.tensor([2, 0])
    exact, steps = 0.0, 4000
    for j in range(steps):
        t = eps + (1 - 2 * eps) * (j + 0.5) / steps
        for z0 in range(k):
            for z1 in range(k):
                z = torch.tensor([[z0, z1]])
                q = ((1 - t) * (z0 == x[0]) + t / k) * ((1 - t) * (z1 == x[1]) + t / k)
                rate = uniform_nelbo_rate(predict(z)[0], z[0], x, torch.tensor([t, t]))
                exact += q * float(rate.sum()) * (1 - 2 * eps) / steps
    n = 4000
    gens = sample_generators((2, "elbo-toy"), [str(i) for i in range(n)])
    estimates = uniform_nelbo(predict, x.expand(n, -1), torch.ones(n, 2), k, gens, samples=2, eps=eps)
    se = float(estimates.std()) / n**0.5
    assert abs(float(estimates.mean()) - exact) < 4 * se, (float(estimates.mean()), exact, se)
    assert se < 0.05 * exact  # the test has power


def test_the_estimators_variance_on_a_toy():
    """The exact variance of the estimate on the toy of the test above (every z enumerated, the time
    by quadrature): one sample's, and R rows at stratified times (ESPO's rows, the eval's ll) given
    the shared offset u, Var = E_u[sum_r Var_z(row r)] / R^2 + Var_u[mean_r E_z(row r)]. Stratified
    times never do worse than R independent samples, but here they hardly do better: nearly all
    the variance is the noise draw's (a token replaced at a small t costs ~K/t), not the time's."""
    import itertools

    from dare_core.diffusion.uniform import uniform_nelbo_rate

    k, eps, n = 4, 1e-4, 20000
    g = generator(1, "elbo-toy")
    own, other = 1.5 * torch.randn(2, k, k, generator=g, dtype=torch.float64), torch.randn(2, k, k, generator=g, dtype=torch.float64)
    zs = torch.tensor(list(itertools.product(range(k), repeat=2)))
    logits = torch.stack([own[0][zs[:, 0]] + other[0][zs[:, 1]], own[1][zs[:, 1]] + other[1][zs[:, 0]]], dim=1)
    x = torch.tensor([2, 0])

    def moments(t):  # E_z and E_z[.^2] of one row's value at each time t
        q = (((1 - t)[:, None] * (zs[None, :, 0] == x[0]) + t[:, None] / k)
             * ((1 - t)[:, None] * (zs[None, :, 1] == x[1]) + t[:, None] / k))
        rate = uniform_nelbo_rate(logits[None].expand(len(t), -1, -1, -1).reshape(-1, k), zs[None].expand(len(t), -1, -1).reshape(-1),
                                  x.repeat(len(t) * 16), t.repeat_interleave(32)).view(len(t), 16, 2).sum(-1) * (1 - 2 * eps)
        return (q * rate).sum(-1), (q * rate**2).sum(-1)

    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    m, s2 = moments(eps + (1 - 2 * eps) * u)
    one = float(s2.mean() - m.mean() ** 2)
    for r in (2, 4, 8):
        rows = [moments(eps + (1 - 2 * eps) * (j + u) / r) for j in range(r)]
        noise = sum(float((s - mm**2).mean()) for mm, s in rows) / r**2
        time = float((sum(mm for mm, _ in rows) / r).var(unbiased=False))
        assert noise + time < 1.001 * one / r  # stratification never hurts (up to the quadrature's error) ...
        assert time < 0.02 * noise  # ... and the time's share is small: the noise draws dominate
        torch.testing.assert_close(noise + time, one / r, rtol=0.01, atol=0)


def test_the_canvas_predictor_reads_each_canvas_after_its_clean_context():
    from dare_core.diffusion.uniform import canvas_predictor

    net = _net()
    batch = canvas_batch([[5, 6, 7]], [[10, 11, 12, 13, 14, 15]], C, EOS, PAD)  # 2 canvases
    noisy = torch.randint(0, V, (1, 8), generator=generator(4, "noisy"))
    with torch.no_grad():
        got = canvas_predictor(net, batch)(noisy)
        first = net.canvas_logits(batch.ids[:, :3], noisy[:, :4])
        second = net.canvas_logits(batch.ids[:, :7], noisy[:, 4:])
    torch.testing.assert_close(got, torch.cat([first, second], dim=1), rtol=1e-6, atol=1e-6)


def test_d1_scores_under_uniform_noise_are_the_decoders_canvas_by_canvas():
    """d1's corruption without a mask token (every response token random, a share of the prompt
    too, from each row's generator) scored in one forward equals the decoder run canvas by canvas:
    over the noised prompt and the clean canvases before it, each row alone and unpadded; scores
    only at valid positions, zero elsewhere."""
    import tiny_models
    from dare_core.diffusion.likelihood import token_logprobs
    from dare_core.diffusion.masking import full_response_corruption

    model = tiny_models.tiny("diffusion_gemma", seed=2).double()
    c = model.block_size
    prompts, responses = [[5, 6, 7], [9]], [[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]]
    p = 3
    ids = torch.tensor([prompts[0] + responses[0], [PAD, PAD] + prompts[1] + responses[1]])
    attn = torch.tensor([[1] * 11, [0, 0] + [1] * 9])
    valid = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    gens = sample_generators((0, "d1-uniform"), ["a", "b"])
    corruption = full_response_corruption(ids, attn, p, valid, None, 0.5, gens, model.config.vocab_size)
    again = full_response_corruption(ids, attn, p, valid, None, 0.5, sample_generators((0, "d1-uniform"), ["a", "b"]),
                                     model.config.vocab_size)
    assert torch.equal(corruption.noisy_ids, again.noisy_ids) and corruption.prompt_len == p
    assert (corruption.noisy_ids[:, p:] != ids[:, p:]).float().mean() > 0.8  # the response: random tokens
    assert torch.equal(corruption.noisy_ids[1, :2], ids[1, :2])  # padding is never noised
    scores = token_logprobs(model, corruption, ids, attn)
    assert scores.dtype == torch.float32 and (scores[:, :p] == 0).all() and (scores[1, p + 5:] == 0).all()
    with torch.no_grad():
        for b, (left, n) in enumerate(((0, 3), (2, 1))):
            prompt = corruption.noisy_ids[b, left:p]
            for k in range(2):
                prefix = torch.cat([prompt, ids[b, p:p + k * c]])[None]
                canvas = corruption.noisy_ids[b, p + k * c:p + (k + 1) * c][None]
                logp = model.net.canvas_logits(prefix, canvas)[0].double().log_softmax(-1)
                expected = logp.gather(-1, ids[b, p + k * c:p + (k + 1) * c, None])[:, 0]
                got = scores[b, p + k * c:p + (k + 1) * c].double()
                keep = valid[b, k * c:(k + 1) * c]
                torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=1e-5)
    token_logprobs(model, corruption, ids, attn).sum().backward()  # (differentiable: what d1's update needs)
    assert model.net.embed.weight.grad.abs().sum() > 0


def test_the_rl_elbo_rows_average_to_the_uniform_nelbo_estimate():
    """ESPO's rows under uniform noise (`uniform_time_rows`: stratified times, each row one
    corrupted copy) scored by `elbo_rows` average to minus `uniform_nelbo` over the canvas predictor
    for the same generators (the same draws in the same order), each row inside its time stratum,
    only valid positions scored; differentiable."""
    import tiny_models
    from dare_core.diffusion.likelihood import elbo_rows
    from dare_core.diffusion.mc_laws import uniform_time_rows
    from dare_core.diffusion.uniform import CanvasBatch, canvas_predictor, uniform_nelbo

    model = tiny_models.tiny("diffusion_gemma", seed=4).double()
    c, v, p, rows = model.block_size, model.config.vocab_size, 3, 4
    ids = torch.tensor([[5, 6, 7] + list(range(10, 18)), [PAD, PAD, 9] + list(range(20, 25)) + [EOS] * 3])
    attn = torch.tensor([[1] * 11, [0, 0] + [1] * 9])
    valid = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    seeds = ((1, "uniform-rows"), ["a", "b"])
    corruptions = uniform_time_rows(ids, p, valid, v, rows, sample_generators(*seeds), tail_fill=EOS)
    for r, row in enumerate(corruptions.rows):
        lo, hi = 1e-4 + (1 - 2e-4) * r / rows, 1e-4 + (1 - 2e-4) * (r + 1) / rows
        assert ((lo <= row.p) & (row.p <= hi)).all() and torch.equal(row.scored[:, p:], valid)
        assert torch.equal(row.noisy_ids[:, :p], ids[:, :p])  # the prompt stays clean
    e = elbo_rows(model, corruptions.rows, ids, attn)
    assert e.shape == (2, rows) and (e < 0).all()
    with torch.no_grad():
        expected = -uniform_nelbo(canvas_predictor(model.net, CanvasBatch(ids, attn, p, c)), ids[:, p:], valid, v,
                                  sample_generators(*seeds), rows)
    torch.testing.assert_close(e.double().mean(1), expected, rtol=1e-5, atol=1e-5)
    e.sum().backward()
    assert model.net.embed.weight.grad.abs().sum() > 0
