"""The uniform-noise step rule (dare_core/sampling/uniform_noise.py) against DiffusionGemma's
reference pieces in transformers: the linear temperature schedule, the entropy-bound acceptance,
the stable-and-confident stop, and one whole step drawing the reference's random numbers in its
order (one row, the reference's global seed = our generator's seed)."""
import pytest
import torch

from dare_core.diffusion.seeding import generator
from dare_core.sampling.uniform_noise import (StableAndConfident, UniformNoiseRule, denoise_step, entropy_bound_accept,
                                              random_canvas)

reference = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

V, C = 50, 12


def _logits(seed: int, rows: int = 3, scale: float = 4.0) -> torch.Tensor:
    return scale * torch.randn(rows, C, V, generator=generator(seed, "uniform-noise-logits"))


def test_the_temperature_schedule_is_the_references():
    rule = UniformNoiseRule(t_min=0.4, t_max=0.8, max_steps=48)
    ref = reference.LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, 48)
    x = torch.ones(1, 1, 1)
    for remaining in (48, 30, 1):
        torch.testing.assert_close(x / rule.temperature(remaining), ref(None, x, remaining))


@pytest.mark.parametrize("bound", [0.01, 0.1, 2.0])
def test_entropy_bound_acceptance_is_the_references(bound):
    ref = reference.EntropyBoundSampler(reference.EntropyBoundSamplerConfig(entropy_bound=bound), C, V, 48)
    for seed in range(4):
        logits = _logits(seed, scale=1.0 + 3 * seed)
        ref.accept_canvas(torch.zeros(3, C, dtype=torch.long), torch.ones(3, C, dtype=torch.long), logits, 1)
        accepted = entropy_bound_accept(logits, bound)
        assert torch.equal(accepted, ref.accepted_token_mask)
        assert accepted.sum(-1).min() >= 1  # the lowest-entropy position always passes


def test_stopping_is_the_references():
    ours, ref = StableAndConfident(2, 0.5), reference.StableAndConfidentStoppingCriteria(2, 0.5)
    canvases = [torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 5]]), torch.tensor([[1, 2], [3, 5]]),
                torch.tensor([[1, 2], [3, 5]])]
    peaked = torch.full((2, 2, 6), -30.0)
    peaked[..., 0] = 30.0
    flat = torch.zeros(2, 2, 6)
    for i, canvas in enumerate(canvases):
        logits = peaked if i else flat
        assert torch.equal(ours(canvas, logits), ref(canvas, logits))
    assert ours(canvases[-1], peaked).tolist() == [True, True]
    ours.reset()
    assert ours(canvases[-1], peaked).tolist() == [False, False]  # no history after a reset


def test_a_step_draws_the_references_numbers_in_its_order():
    """The reference draws the proposals with one multinomial over every position and the renoise
    with one randint, from the global generator; a row decoded with a generator of the same seed
    lands on the same canvas."""
    rule = UniformNoiseRule(entropy_bound=0.5, t_min=0.4, t_max=0.8, max_steps=10)
    ref = reference.EntropyBoundSampler(reference.EntropyBoundSamplerConfig(entropy_bound=0.5), C, V, 10)
    logits = _logits(7, rows=1)
    torch.manual_seed(123)
    canvas = ref.initialize_canvas(1, "cpu")
    tempered = logits / rule.temperature(10)
    probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)
    proposal = torch.multinomial(probs.view(-1, V), num_samples=1).view(1, C)
    expected = ref.renoise_canvas(ref.accept_canvas(canvas, proposal, tempered, 10), 10)

    g = torch.Generator().manual_seed(123)
    ours_canvas = random_canvas(1, C, V, g, "cpu")
    assert torch.equal(ours_canvas, canvas)
    nxt, argmax, ours_tempered = denoise_step(ours_canvas, logits, 10, rule, [g])
    assert torch.equal(nxt, expected)
    assert torch.equal(argmax, tempered.argmax(-1)) and torch.equal(ours_tempered, tempered)
    assert 0 < int((nxt == proposal).sum()) < C  # some positions accepted, some renoised
