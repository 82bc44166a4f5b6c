"""SFT loss against a hand computation, and micro-batch invariance of loss and gradient."""
import torch

from conftest import make_tiny_llada
from dare_core.algorithms.registry import build_options, get_sft_objective
from dare_core.data.batching import sft_batch
from dare_core.diffusion.masking import response_corruption, sample_mask_prob
from dare_core.diffusion.seeding import sample_generators


def _setup(loss_norm="answer_length"):
    model = make_tiny_llada()
    cls = get_sft_objective("sft")
    algo = cls(build_options(cls, {"loss_norm": loss_norm}, "sft"), model.mask_token_id)
    batch = sft_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], [[11, 12], [13], [14, 15, 16], [17, 18, 19]], ["a", "b", "c", "d"], 5, model.eos_token_id, model.pad_token_id)
    return model, algo, batch


def test_sft_loss_equals_hand_computation():
    model, algo, batch = _setup()
    gens = lambda: sample_generators((0, "sft", 7), batch.uids)  # noqa: E731
    out = algo.loss(model, batch, gens(), denom=4.0)
    # the same draws, by hand: (1/B) sum_b [sum_{masked} CE / p_b] / n_b
    g = gens()
    p = sample_mask_prob(g)
    corr = response_corruption(batch.input_ids, batch.prompt_len, batch.response_mask, model.mask_token_id, p, g)
    logits = model(corr.noisy_ids, batch.attention_mask).double()
    logp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[..., None]).squeeze(-1)
    expected = 0.0
    for b in range(4):
        masked = corr.scored[b]
        assert not masked[: batch.prompt_len].any()
        expected += (-logp[b][masked]).sum() / p[b] / 5  # n_b = pad_to = 5 (EOS padding counts)
    expected /= 4
    assert out.metrics["masked_tokens"] == corr.scored.sum().item() > 0
    torch.testing.assert_close(out.loss.double(), expected, atol=1e-5, rtol=1e-5)


def test_eos_padding_is_trained_and_prompt_is_not():
    _, _, batch = _setup()
    assert batch.response_mask.all()
    assert (batch.input_ids[1, batch.prompt_len + 1:] == 38).all()  # EOS-padded response
    assert batch.attention_mask[:, batch.prompt_len:].all()  # attended


def test_micro_batch_split_gives_same_loss_and_gradient():
    for norm in ("answer_length", "token", "batch"):
        model, algo, batch = _setup(norm)
        denom = algo.global_denominator([batch.response_mask])
        out = algo.loss(model, batch, sample_generators((0, "sft", 1), batch.uids), denom)
        out.loss.backward()
        full = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        halves = [batch.select(torch.tensor([0, 1])), batch.select(torch.tensor([2, 3]))]
        assert algo.global_denominator([h.response_mask for h in halves]) == denom
        total = 0.0
        for h in halves:
            o = algo.loss(model, h, sample_generators((0, "sft", 1), h.uids), denom)
            o.loss.backward()
            total += o.loss.item()
        assert abs(total - out.loss.item()) < 1e-5
        for a, p in zip(full, model.parameters()):
            torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)


def test_edit_noise_adds_the_token_to_token_stream_by_hand():
    """sft.edit_noise q (LLaDA2.1's T2T stream): each unmasked response token replaced with
    probability q by a random non-MASK id and scored with weight 1, the masked ones with 1/p, in one
    forward over that input; q = 0 is the masked loss exactly."""
    model = make_tiny_llada()
    cls = get_sft_objective("sft")
    vocab = model.config.vocab_size
    algo = cls(build_options(cls, {"edit_noise": 0.4}, "sft"), model.mask_token_id, vocab)
    plain = cls(build_options(cls, {"edit_noise": 0.0}, "sft"), model.mask_token_id, vocab)
    batch = sft_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], [[11, 12], [13], [14, 15, 16], [17, 18, 19]],
                      ["a", "b", "c", "d"], 5, model.eos_token_id, model.pad_token_id)
    gens = lambda: sample_generators((0, "sft-edit", 3), batch.uids)  # noqa: E731
    out = algo.loss(model, batch, gens(), denom=4.0)
    g = gens()
    p = sample_mask_prob(g)
    corr = response_corruption(batch.input_ids, batch.prompt_len, batch.response_mask, model.mask_token_id, p, g)
    P, noisy, expected, edited = batch.prompt_len, corr.noisy_ids.clone(), 0.0, 0
    hits = torch.zeros_like(corr.scored)
    for b, gb in enumerate(g):  # the same generators, continuing after the masks' draws
        hit = (torch.rand(5, generator=gb) < 0.4) & ~corr.scored[b, P:]
        draw = torch.randint(0, vocab - 1, (5,), generator=gb)
        draw = draw + (draw >= model.mask_token_id).long()
        noisy[b, P:] = torch.where(hit, draw, noisy[b, P:])
        hits[b, P:] = hit
        edited += int(hit.sum())
    assert edited > 0 and not (noisy[:, P:][noisy[:, P:] != batch.input_ids[:, P:]] == model.mask_token_id).all()
    logp = torch.log_softmax(model(noisy, batch.attention_mask).double(), -1).gather(-1, batch.input_ids[..., None]).squeeze(-1)
    for b in range(4):
        masked = corr.scored[b]
        expected += ((-logp[b][masked]).sum() / p[b] + (-logp[b][hits[b]]).sum()) / 5  # (a draw of the clean id counts too)
    torch.testing.assert_close(out.loss.double(), expected / 4, atol=1e-5, rtol=1e-5)
    assert out.metrics["edited_tokens"] == edited
    torch.testing.assert_close(plain.loss(model, batch, gens(), 4.0).loss, _setup_loss(model, batch, gens()))


def _setup_loss(model, batch, generators):
    cls = get_sft_objective("sft")
    return cls(build_options(cls, {}, "sft"), model.mask_token_id).loss(model, batch, generators, 4.0).loss
