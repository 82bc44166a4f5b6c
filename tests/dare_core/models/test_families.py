"""Every family: a tiny random checkpoint in the real on-disk layout reloads to bit-identical
logits; each family's attention pattern and logit alignment behave as its published code does."""
import json

import pytest
import torch

from dare_core.diffusion.seeding import generator
from dare_core.models.hf_folder import load_model, save_model
from tiny_models import FAMILIES, tiny

@pytest.mark.parametrize("model_type", FAMILIES)
def test_round_trip_in_the_real_layout_is_bit_identical(tmp_path, model_type):
    model = tiny(model_type)
    folder = save_model(model, tmp_path / model_type, max_shard_bytes=30_000)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == model.family.model_type and "architectures" in cfg  # llada_moe keeps "llada"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.hf_state_dict())
    reloaded = load_model(folder).eval()
    assert reloaded.family is model.family  # LLaDA-MoE is told apart from LLaDA-8B by its config
    x = torch.randint(0, 60, (2, 12), generator=generator(1, "x"))
    attn = torch.ones_like(x)
    attn[1, :3] = 0
    assert torch.equal(model(x, attn), reloaded(x, attn))
    bf = load_model(folder, dtype=torch.bfloat16).eval()
    assert bf(x, attn).dtype == torch.bfloat16


def test_dream_logits_are_shifted():
    model = tiny("Dream")
    x = torch.randint(0, 60, (1, 10), generator=generator(2, "x"))
    raw = model.net(x)
    aligned = model(x)
    assert torch.equal(aligned[:, 1:], raw[:, :-1]) and torch.equal(aligned[:, 0], raw[:, 0])
    rows = torch.zeros(1, 10, dtype=torch.bool)
    rows[0, [0, 4, 9]] = True
    torch.testing.assert_close(model.logits_at(model.hidden_states(x), rows), aligned[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type,block", [("sdar", 4), ("sdar_moe", 4), ("llada2_moe", 32)])
def test_block_families_attend_block_causally(model_type, block):
    model = tiny(model_type)
    assert model.block_size == block
    n = 3 * block if block < 32 else 40
    x = torch.randint(0, 60, (1, n), generator=generator(3, "x"))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 60  # change a token in the last block
    lx, ly = model(x), model(y)
    last_block_start = ((n - 1) // block) * block
    # earlier blocks never see it (MoE: up to float reassociation, since routing batches change)
    torch.testing.assert_close(lx[:, :last_block_start], ly[:, :last_block_start], atol=1e-5, rtol=0)
    assert not torch.allclose(lx[:, last_block_start:-1], ly[:, last_block_start:-1])  # its own block does


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_masked_families_are_bidirectional(model_type):
    model = tiny(model_type)
    x = torch.randint(0, 60, (1, 8), generator=generator(4, "x"))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 60
    assert not torch.allclose(model(x)[0, 2], model(y)[0, 2])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_left_padding_never_reaches_real_tokens(model_type):
    model = tiny(model_type)
    x = torch.randint(0, 60, (1, 9), generator=generator(5, "x"))
    alone = model(x)
    for pad_token in (7, 11):
        padded = torch.cat([torch.full((1, 5), pad_token), x], dim=1)
        attn = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
        torch.testing.assert_close(model(padded, attn)[:, 5:], alone, atol=1e-5, rtol=1e-5)


def test_llada2_router_bias_selects_but_does_not_weight():
    model = tiny("llada2_moe")
    moe = model.net.layers[1].mlp
    x = torch.randn(5, 32, generator=generator(6, "x"))
    idx, w = moe.route(x)
    assert idx.shape == (5, 4) and torch.allclose(w.sum(-1), torch.full((5,), 2.5))  # renormalised, then scaled
    # experts come from at most topk_group groups of 4
    assert all(len({e // 4 for e in row.tolist()}) <= 2 for row in idx)
    # a huge bias on one expert forces its selection; its weight is still its unbiased score
    moe.expert_bias.zero_()
    moe.expert_bias[5] = 100.0
    idx2, w2 = moe.route(x)
    assert (idx2 == 5).any(-1).all()
    scores = torch.sigmoid(torch.nn.functional.linear(x.float(), moe.router.weight.float()))
    expected = scores.gather(-1, idx2)
    torch.testing.assert_close(w2, 2.5 * expected / expected.sum(-1, keepdim=True))


def test_sdar_moe_router_is_softmax_topk_renormalised():
    model = tiny("sdar_moe")
    moe = model.net.layers[0].mlp
    x = torch.randn(6, 32, generator=generator(7, "x"))
    idx, w = moe.route(x)
    probs = torch.softmax(torch.nn.functional.linear(x, moe.router.weight), -1)
    top = probs.topk(2, dim=-1)
    assert torch.equal(idx, top.indices)
    torch.testing.assert_close(w, top.values / top.values.sum(-1, keepdim=True))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(model_type):
    model = tiny(model_type).train()
    x = torch.randint(0, 60, (2, 9), generator=generator(8, "x"))
    model(x).logsumexp(-1).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.set_gradient_checkpointing(True)
    model(x).logsumexp(-1).sum().backward()
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-5)


def test_every_family_carries_its_own_facts():
    """Adding a family touches its model file (and its tiny fixture) only: the sampler defaults it is
    evaluated with, its OpenCompass class label, the engines that decode it and its tokenizer's class
    names are fields of its Family, which evaluation, the engines and the tokenizer loader read."""
    from dataclasses import fields

    from dare_core.eval.lm import family_sampler_defaults
    from dare_core.models.family import own_families
    from dare_core.sampling.engines import engine_class
    from dare_core.sampling.params import SamplingParams

    settings = {f.name for f in fields(SamplingParams)}
    for family in own_families():
        assert family.eval_label, f"{family.model_type}: no eval_label"
        assert set(family.sampler_defaults) <= settings, family.model_type
        assert family_sampler_defaults(family.model_type) == family.sampler_defaults
        assert all(engine_class(engine).name == engine for engine in family.engines), family.model_type
    assert family_sampler_defaults("llada_moe") == {} and family_sampler_defaults(None) == {}  # an alias is no model_type


def test_expert_groups_are_the_per_expert_assignments():
    """The routed experts' one-sync grouping (`expert_groups`) lists, expert by expert in ascending
    order, the (token, slot) assignments `(idx == e).nonzero()` gives, in its order (so the experts'
    outputs are summed in the same order as before), experts nobody chose left out."""
    from dare_core.models.transformer import expert_groups

    g = generator(8, "routes")
    for tokens, k, experts in ((37, 4, 16), (1, 2, 8), (300, 8, 256)):
        idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        want = [(e, *(idx == e).nonzero(as_tuple=True)) for e in idx.unique().tolist()]
        got = expert_groups(idx, experts)
        assert [e for e, _, _ in got] == [e for e, _, _ in want]
        for (_, token, slot), (_, token2, slot2) in zip(got, want):
            assert torch.equal(token, token2) and torch.equal(slot, slot2)
