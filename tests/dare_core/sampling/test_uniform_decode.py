"""DiffusionGemma decoded by DARE's one loop (sampling/decode.py with the entropy_bound_renoise rule
and the encoder cache) against transformers' own `generate` on the same tiny model: token for token
and step for step, one prompt at a time with the reference's global seed as the row's generator
seed, across canvases, with and without early stopping. A row decodes the same in any batch (left
padding and neighbours that stop earlier included), and the encoder cache gives what one pass
without it gives."""
import pytest
import torch

from dare_core.diffusion.seeding import generator
from dare_core.models.hf_folder import load_model
from dare_core.sampling.decode import generate
from dare_core.sampling.params import SamplingParams
from diffusion_gemma_reference import saved_reference

gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

EOS, C = 1, 8
# (entropy bound, stop entropy, stable steps): few tokens accepted a step and no early stop (the
# released defaults), then many accepted and blocks that stop once their entropy is low enough
RULES = [(0.1, 0.005, 1), (2.0, 0.5, 0)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref, folder = saved_reference(tmp_path_factory.mktemp("diffusion_gemma"), eos=EOS, canvas_length=C, embed_scale=40.0)
    return ref, load_model(folder).eval()


def _params(bound: float, stop: float, stable: int, blocks: int = 3, cache: str = "block_kv") -> SamplingParams:
    return SamplingParams(gen_length=blocks * C, block_length=C, steps=blocks * 6, unmasking="entropy_bound_renoise",
                          temperature=0.8, temperature_min=0.4, entropy_bound=bound, stable_steps=stable, stop_entropy=stop,
                          cache=cache, stop_token_ids=[])


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, 64, (length,), generator=generator(seed, "uniform-decode-prompt")).tolist()


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.mark.parametrize("bound,stop,stable", RULES)
def test_one_prompt_decodes_as_the_reference_generate(pair, bound, stop, stable):
    ref, model = pair
    params = _params(bound, stop, stable)
    early = 0
    for seed in range(6):
        prompt = _prompt(seed, 5 + seed)
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=params.gen_length, max_denoising_steps=6,
                                    sampler_config=gen.EntropyBoundSamplerConfig(entropy_bound=bound),
                                    t_min=0.4, t_max=0.8, stability_threshold=stable, confidence_threshold=stop,
                                    eos_token_id=EOS, pad_token_id=0)
        new = expected.sequences[0, len(prompt):].tolist()
        out = generate(model, [prompt], params, generators=[torch.Generator().manual_seed(seed)])
        got = _until_eos(out.response[0].tolist())
        assert got == _until_eos(new), seed
        # the reference's forward passes: its valid tokens over its tokens a forward
        passes = round(float((torch.tensor(new) != 0).sum() / expected.tokens_per_forward[0]))
        assert int(out.steps[0]) == passes, seed
        early += int(out.steps[0]) < 6 * ((len(got) + C - 1) // C)
    if stable == 0:
        assert early > 0  # some blocks stopped before their last step


@pytest.mark.parametrize("bound,stop,stable", RULES)
def test_a_row_decodes_the_same_in_any_batch(pair, bound, stop, stable):
    _, model = pair
    params = _params(bound, stop, stable)
    prompts = [_prompt(10 + i, n) for i, n in enumerate((3, 9, 5, 12))]
    seeds = [torch.Generator().manual_seed(100 + i) for i in range(4)]
    batch = generate(model, prompts, params, generators=seeds)
    for i, prompt in enumerate(prompts):
        alone = generate(model, [prompt], params, generators=[torch.Generator().manual_seed(100 + i)])
        assert batch.response[i].tolist() == alone.response[0].tolist(), i
        assert int(batch.steps[i]) == int(alone.steps[0]), i


def test_the_encoder_cache_decodes_as_one_pass_without_it(pair):
    _, model = pair
    prompts = [_prompt(20 + i, n) for i, n in enumerate((4, 11))]
    outs = [generate(model, prompts, _params(2.0, 0.5, 0, cache=cache), generators=[torch.Generator().manual_seed(s) for s in (5, 6)])
            for cache in ("block_kv", "none")]
    assert outs[0].response.tolist() == outs[1].response.tolist()
    assert outs[0].steps.tolist() == outs[1].steps.tolist()


def test_the_rule_must_fit_the_noise(pair, tiny_llada):
    _, model = pair
    with pytest.raises(ValueError, match="does not apply to a uniform-noise model"):
        generate(model, [[3, 4]], SamplingParams(gen_length=8, block_length=8, steps=8, cache="block_kv"))
    with pytest.raises(ValueError, match="does not apply to a masked-noise model"):
        generate(tiny_llada, [[3, 4]], SamplingParams(gen_length=8, block_length=8, steps=8, unmasking="entropy_bound_renoise",
                                                      temperature=0.8), generators=[torch.Generator()])
