"""Resuming the denoising loop from a given state over a range of its steps (the tree rollouts of
d-TreeRPO): split runs commit exactly what one uninterrupted run commits."""
import pytest
import torch

from dare_core.diffusion.seeding import sample_generators
from dare_core.sampling.decode import SamplingParams, denoise_range, generate

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16]]
UIDS = ["a", "b", "c", "d"]


class EosBias(torch.nn.Module):
    """The tiny model with a raised EOS logit, so that rows stop early (in different blocks)."""

    def __init__(self, model, bias):
        super().__init__()
        self.model, self.bias = model, bias
        for k in ("family", "mask_token_id", "eos_token_id", "pad_token_id", "max_sequence_length", "config", "block_size"):
            setattr(self, k, getattr(model, k))

    def window_hidden(self, *args, **kwargs):
        return self.model.window_hidden(*args, **kwargs)

    def column_logits(self, *args):
        logits = self.model.column_logits(*args).clone()
        logits[..., self.eos_token_id] += self.bias
        return logits


def _split_run(model, params, cuts, temperature):
    """denoise_range over [0, c1), [c1, c2), ... [ck, steps), each from the previous state, the same
    generators continuing throughout (the randomness of one uninterrupted run)."""
    gens = sample_generators((3,), UIDS) if temperature > 0 else None
    bounds = [0, *cuts, params.steps]
    state = torch.full((len(PROMPTS), params.gen_length), model.mask_token_id)
    out = None
    for j0, j1 in zip(bounds, bounds[1:]):
        out = denoise_range(model, PROMPTS, params, state, (j0, j1), generators=gens)
        state = out.trajectory.response_tokens(params.gen_length)
    return out, state


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("layout,cuts", [
    ((8, 8, 8), [4]),  # one block, cut in its middle
    ((8, 8, 8), [1, 3, 7]),
    ((12, 6, 4), [3]),  # three blocks of two steps: cut inside block 1
    ((12, 6, 4), [2, 4]),  # cuts on block boundaries
    ((12, 12, 4), [5, 6, 11]),
    ((8, 4, 4), [1]),  # fewer steps than block positions
])
@pytest.mark.parametrize("stop_at_eos,eos_bias", [(False, 0.0), (True, 0.0), (True, 2.0)])
def test_split_runs_equal_one_run(tiny_llada, temperature, layout, cuts, stop_at_eos, eos_bias):
    L, steps, block = layout
    model = EosBias(tiny_llada, eos_bias) if eos_bias else tiny_llada
    params = SamplingParams(gen_length=L, steps=steps, block_length=block, temperature=temperature, stop_at_eos=stop_at_eos)
    gens = sample_generators((3,), UIDS) if temperature > 0 else None
    whole = generate(model, PROMPTS, params, generators=gens, record="steps")
    split, state = _split_run(model, params, cuts, temperature)
    if eos_bias and block < L:
        assert "eos" in whole.stop_reason and (whole.steps < steps).any()  # rows left early
    assert torch.equal(split.response, whole.response)
    assert torch.equal(state, whole.trajectory.response_tokens(L))
    assert torch.equal(split.sequences, whole.sequences)


def test_partial_run_state_and_commit_counts(tiny_llada):
    """After [0, j) of a one-block schedule with one token per step exactly j positions are decoded;
    the rest stay MASK in the state (the EOS-filled `response` is not a state)."""
    params = SamplingParams(gen_length=8, steps=8, block_length=8, stop_at_eos=False)
    mask = tiny_llada.mask_token_id
    init = torch.full((len(PROMPTS), 8), mask)
    out = denoise_range(tiny_llada, PROMPTS, params, init, (0, 3))
    state = out.trajectory.response_tokens(8)
    assert ((state != mask).sum(-1) == 3).all()
    assert (out.steps == 3).all()
    nxt = denoise_range(tiny_llada, PROMPTS, params, state, (3, 5))
    after = nxt.trajectory.response_tokens(8)
    assert ((after != mask).sum(-1) == 5).all()
    assert torch.equal(after[state != mask], state[state != mask])  # committed tokens are kept


def test_resume_is_refused_where_it_is_not_defined(tiny_llada):
    init = torch.full((1, 8), tiny_llada.mask_token_id)
    with pytest.raises(ValueError, match="cache: none"):
        denoise_range(tiny_llada, [[1, 2]], SamplingParams(gen_length=8, steps=8, block_length=8, cache="dual"), init, (0, 4))
    with pytest.raises(ValueError, match="count"):
        denoise_range(tiny_llada, [[1, 2]], SamplingParams(gen_length=8, steps=8, block_length=8, unmasking="threshold"), None, (0, 4))
    with pytest.raises(ValueError, match="within"):
        denoise_range(tiny_llada, [[1, 2]], SamplingParams(gen_length=8, steps=8, block_length=8), None, (2, 9))
    with pytest.raises(ValueError, match="init_response must be"):
        denoise_range(tiny_llada, [[1, 2]], SamplingParams(gen_length=8, steps=8, block_length=8), init[:, :4], (0, 8))
