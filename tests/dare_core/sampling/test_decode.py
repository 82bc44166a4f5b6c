"""Sampler invariants of the LLaDA low-confidence remasking loop (docs/sampling.md#low-confidence-remasking)."""
import pytest
import torch
from scipy.stats import chisquare

from dare_core.diffusion.seeding import sample_generators
from dare_core.sampling.decode import SamplingParams, generate
from dare_core.sampling import unmasking
from dare_core.sampling.unmasking import gumbel_argmax, scheduled_counts

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16]]


class Recorder(torch.nn.Module):
    """Wraps a model and keeps every input it is asked to denoise."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.inputs = []
        self.family, self.mask_token_id, self.eos_token_id = model.family, model.mask_token_id, model.eos_token_id
        self.pad_token_id, self.max_sequence_length = model.pad_token_id, model.max_sequence_length

        self.config, self.block_size = model.config, model.block_size

    def window_hidden(self, x, *args, **kwargs):
        self.inputs.append(x.clone())
        return self.model.window_hidden(x, *args, **kwargs)

    def column_logits(self, *args):
        return self.model.column_logits(*args)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_committed_tokens_never_change_and_every_position_is_decoded(tiny_llada, temperature):
    rec = Recorder(tiny_llada)
    params = SamplingParams(gen_length=12, steps=6, block_length=4, temperature=temperature, stop_at_eos=False)
    out = generate(rec, PROMPTS, params, generators=sample_generators((0,), list("abcd")), record="steps")
    mask = tiny_llada.mask_token_id
    assert out.response.shape == (4, 12) and not (out.response == mask).any()
    final = torch.cat([out.sequences[:, :out.prompt_len], out.trajectory.tokens], 1)
    for before, after in zip(rec.inputs, rec.inputs[1:] + [final]):
        committed = before != mask
        assert torch.equal(before[committed], after[committed])
    assert out.nfe == len(rec.inputs) == 6
    # every response position has exactly one commit step, blocks in order
    steps = out.step_map
    assert (steps >= 1).all() and (steps <= 6).all()
    assert (steps[:, :4].max(-1).values < steps[:, 4:8].min(-1).values).all()


def test_one_token_per_step_when_steps_equal_gen_length(tiny_llada):
    out = generate(tiny_llada, PROMPTS, SamplingParams(gen_length=8, steps=8, block_length=8, stop_at_eos=False), record="steps")
    for row in out.step_map:
        assert sorted(row.tolist()) == list(range(1, 9))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_equals_one_at_a_time_with_left_padding(tiny_llada, temperature):
    params = SamplingParams(gen_length=8, steps=4, block_length=4, temperature=temperature)
    uids = ["p0", "p1", "p2", "p3"]
    batched = generate(tiny_llada, PROMPTS, params, generators=sample_generators((5,), uids))
    for i, p in enumerate(PROMPTS):
        alone = generate(tiny_llada, [p], params, generators=sample_generators((5,), [uids[i]]))
        assert torch.equal(alone.response[0], batched.response[i])


def test_prompt_is_never_touched_and_too_long_prompt_is_refused(tiny_llada):
    out = generate(tiny_llada, PROMPTS, SamplingParams(gen_length=8, steps=8, block_length=4))
    for i, p in enumerate(PROMPTS):
        assert out.sequences[i, out.prompt_len - len(p): out.prompt_len].tolist() == p
    with pytest.raises(ValueError, match="more than the model's maximum length 64"):
        generate(tiny_llada, [[1] * 60], SamplingParams(gen_length=8, steps=8, block_length=8))


def test_linear_schedule_splits_evenly():
    for m in range(0, 40):
        for s in (1, 3, 4, 7):
            params = SamplingParams(gen_length=8 * s, steps=s, block_length=8 * s)
            k = [scheduled_counts(params, torch.tensor([m]), torch.tensor([m]), j).item() for j in range(s)]
            assert sum(k) == m and max(k) - min(k) <= 1


def test_gumbel_samples_from_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    draws = gumbel_argmax(logits.expand(1, 50_000, 5), 0.7, [torch.Generator().manual_seed(0)])[0]
    counts = torch.bincount(draws, minlength=5).double()
    expected = torch.softmax(logits.double() / 0.7, -1) * counts.sum()
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
    assert torch.equal(gumbel_argmax(logits.expand(1, 3, 5), 0.0, None), torch.zeros(1, 3, dtype=torch.long))


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="divisible by block_length"):
        SamplingParams(gen_length=10, block_length=4)
    with pytest.raises(ValueError, match="divisible by the number of blocks"):
        SamplingParams(gen_length=8, block_length=4, steps=3)


@pytest.mark.parametrize("group_rows", [1, 2, 5])
def test_gumbel_rows_grouped_draw_what_each_row_draws_alone(monkeypatch, group_rows):
    """Reducing rows together (groups of any size, a short last one) gives each row the tokens its
    own generator gives it alone: same noise, same float64 arithmetic."""
    logits = torch.randn(5, 3, 11) * 3
    def alone(i):  # the draw written out: each row's float64 uniforms from its own generator
        u = torch.rand((3, 11), generator=torch.Generator().manual_seed(10 + i), dtype=torch.float64)
        return (logits[i].double() - 0.8 * torch.log(-torch.log(u))).argmax(-1)
    expected = torch.stack([alone(i) for i in range(5)])
    monkeypatch.setattr(unmasking, "NOISE_GROUP_BYTES", group_rows * 3 * 11 * 8)
    grouped = gumbel_argmax(logits, 0.8, [torch.Generator().manual_seed(10 + i) for i in range(5)])
    assert torch.equal(grouped, expected)
    # and each generator advanced as far as a lone draw advances it, so the next step matches too
    gens = [torch.Generator().manual_seed(10 + i) for i in range(5)]
    gumbel_argmax(logits, 0.8, gens)
    lone = torch.Generator().manual_seed(10)
    torch.rand((3, 11), generator=lone, dtype=torch.float64)
    assert torch.equal(torch.rand(4, generator=gens[0]), torch.rand(4, generator=lone))


@pytest.mark.gpu
def test_gumbel_rows_grouped_on_the_gpu_draw_what_each_row_draws_alone(monkeypatch):
    """On CUDA the grouped draw writes each row's noise in place and reduces through the compiled
    kernel over all rows of the group: the same tokens as one row at a time."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    logits = torch.randn(6, 4, 50_000, device="cuda") * 3

    def draw(group_rows):
        monkeypatch.setattr(unmasking, "NOISE_GROUP_BYTES", group_rows * 4 * 50_000 * 8)
        gens = [torch.Generator(device="cuda").manual_seed(7 + i) for i in range(6)]
        return gumbel_argmax(logits, 0.9, gens), torch.stack([torch.rand(3, generator=g, device="cuda") for g in gens])

    one, after_one = draw(1)
    for group_rows in (4, 6):
        grouped, after = draw(group_rows)
        assert torch.equal(grouped, one) and torch.equal(after, after_one)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_forward_work_counts_the_columns_each_forward_encoded(cache):
    """`work`: rows x window columns, x key columns, and rows x logit columns, over the forwards
    the loop made (what a rollout's FLOPs are computed from)."""
    from tiny_models import tiny

    model = tiny("llada")
    n_blocks, bl, spb = 2, 4, 4
    params = SamplingParams(gen_length=n_blocks * bl, steps=n_blocks * spb, block_length=bl, cache=cache, stop_at_eos=False)
    out = generate(model, PROMPTS, params)
    B, S = len(PROMPTS), max(map(len, PROMPTS)) + n_blocks * bl
    assert out.nfe == n_blocks * spb
    if cache == "none":  # every step encodes the whole canvas against itself
        windows = [(S, S)] * out.nfe
    else:  # a block: one refresh of the canvas, then its own columns against the cache
        windows = ([(S, S)] + [(bl, S)] * (spb - 1)) * n_blocks
    assert out.work == {"encoded_tokens": B * sum(w for w, _ in windows), "key_pairs": B * sum(w * k for w, k in windows),
                        "logit_tokens": B * bl * out.nfe}


def test_lora_merged_decoding_decodes_what_the_adapter_does():
    """Folded adapters (float64, where the two forwards differ by summation order only) decode the
    same tokens from the same seeds, and the weights are the training ones again after."""
    from dare_core.models.lora import LoraSettings, apply_lora, lora_layers
    from tiny_models import tiny

    model = apply_lora(tiny("llada").double(), LoraSettings(r=4, alpha=8))
    for i, layer in enumerate(lora_layers(model.net)):
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.2, generator=torch.Generator().manual_seed(i))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = SamplingParams(gen_length=8, steps=8, block_length=4, cache="dual", temperature=0.8)
    uids = [str(i) for i in range(len(PROMPTS))]
    with_adapter = generate(model, PROMPTS, params, generators=sample_generators((0,), uids))
    folded = generate(model, PROMPTS, SamplingParams(**{**params.__dict__, "lora_merged": True}), generators=sample_generators((0,), uids))
    assert torch.equal(folded.sequences, with_adapter.sequences)
    assert folded.sampler["lora_merged"] is True
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    plain = generate(tiny("llada").double(), PROMPTS, params, generators=sample_generators((0,), uids))
    assert not torch.equal(plain.sequences, with_adapter.sequences)  # the adapter does change the decoding
