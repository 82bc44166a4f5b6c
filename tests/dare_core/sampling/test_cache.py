"""Cache policies against decoding without a cache, for every family (docs/sampling.md#fast-dllm-caches, docs/sampling.md#block-diffusion-decoding, docs/sampling.md#rollout-records).

Models run in float64 so that "equal" means equal tokens, not equal up to a near-tie."""
import pytest
import torch

from dare_core.diffusion.seeding import sample_generators
from dare_core.models.transformer import KVCache
from dare_core.sampling.decode import Canvas, generate
from dare_core.sampling.params import SamplingParams
from tiny_models import FAMILIES, tiny

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16, 17, 18]]
MASKED = [f for f in FAMILIES if f in ("llada", "llada_moe", "Dream")]
BLOCK = [f for f in FAMILIES if f not in MASKED]


def model_of(family: str):
    return tiny(family).double()


def params_for(model, cache: str, **kw) -> SamplingParams:
    bl = model.block_size or 4
    gen, steps = (bl, bl // 4) if bl >= 8 else (4 * bl, 4 * bl)
    base = dict(gen_length=gen, steps=steps, block_length=bl, cache=cache, stop_at_eos=False)
    return SamplingParams(**{**base, **kw})


@pytest.mark.parametrize("family", MASKED)
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("unmasking", ["topk", "threshold"])
def test_cache_refreshed_every_step_equals_no_cache(family, cache, unmasking):
    model = model_of(family)
    plain = generate(model, PROMPTS, params_for(model, "none", unmasking=unmasking, threshold=0.3))
    cached = generate(model, PROMPTS, params_for(model, cache, refresh_every=1, unmasking=unmasking, threshold=0.3))
    assert torch.equal(plain.sequences, cached.sequences)
    assert cached.nfe == plain.nfe


@pytest.mark.parametrize("family", MASKED)
def test_per_block_refresh_is_an_approximation_that_still_completes(family):
    """Per-block refresh is allowed to differ from no cache (recorded in bench, not asserted)."""
    model = model_of(family)
    for cache in ("prefix", "dual"):
        out = generate(model, PROMPTS, params_for(model, cache))
        assert not (out.response == model.mask_token_id).any()


@pytest.mark.parametrize("family", BLOCK)
@pytest.mark.parametrize("unmasking", ["topk", "dynamic", "threshold"])
def test_block_kv_cache_equals_block_decoding_without_it(family, unmasking):
    model = model_of(family)
    plain = generate(model, PROMPTS, params_for(model, "none", unmasking=unmasking, threshold=0.2), record="steps")
    cached = generate(model, PROMPTS, params_for(model, "block_kv", unmasking=unmasking, threshold=0.2), record="steps")
    assert torch.equal(plain.sequences, cached.sequences)
    assert torch.equal(plain.trajectory.step_map, cached.trajectory.step_map)


@pytest.mark.parametrize("family", BLOCK)
def test_prefill_in_windows_equals_one_prefill(family, monkeypatch):
    """A long prompt's prefill runs in windows of whole blocks (cache.PREFILL_TOKENS over all rows):
    a prompt block reads only the blocks before it, so the cache, the tokens and the step map are
    those of one prefill forward."""
    from dare_core.sampling import cache as cache_policies

    model = model_of(family)
    bl = model.block_size
    long_prompts = [[1 + i % 40 for i in range(2 * bl + 2)], [3 + i % 40 for i in range(2 * bl)], [4, 5, 6]]
    params = params_for(model, "block_kv", unmasking="dynamic", threshold=0.2)
    whole = generate(model, long_prompts, params, record="steps")
    policy = cache_policies.build_cache_policy(params, 0, True)
    monkeypatch.setattr(cache_policies, "PREFILL_TOKENS", bl * len(long_prompts))  # one block a window
    assert [(w.start, w.end, w.key_end) for w in policy.prefill(3 * bl, len(long_prompts))] == [
        (0, bl, bl), (bl, 2 * bl, 2 * bl), (2 * bl, 3 * bl, 3 * bl)]
    chunked = generate(model, long_prompts, params, record="steps")
    assert torch.equal(whole.sequences, chunked.sequences)
    assert torch.equal(whole.trajectory.step_map, chunked.trajectory.step_map)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batch_equals_each_prompt_alone_in_every_cache_mode(family, temperature):
    model = model_of(family)
    caches = ["none", "block_kv"] if model.block_size else ["none", "prefix", "dual"]
    uids = [f"p{i}" for i in range(len(PROMPTS))]
    for cache in caches:
        params = params_for(model, cache, temperature=temperature, top_k=20 if temperature else 0)
        batched = generate(model, PROMPTS, params, generators=sample_generators((3,), uids))
        for i, p in enumerate(PROMPTS):
            alone = generate(model, [p], params, generators=sample_generators((3,), [uids[i]]))
            assert torch.equal(alone.response[0], batched.response[i]), (cache, i)


@pytest.mark.parametrize("family", ["llada", "Dream", "sdar"])
def test_padding_is_never_attended(family):
    """Changing what the pad columns hold changes nothing, in every cache mode."""
    model = model_of(family)
    caches = ["none", "block_kv"] if model.block_size else ["none", "prefix", "dual"]
    for cache in caches:
        params = params_for(model, cache)
        before = generate(model, PROMPTS, params).response
        model.pad_token_id = 5
        after = generate(model, PROMPTS, params).response
        model.pad_token_id = model.eos_token_id
        assert torch.equal(before, after), cache


@pytest.mark.parametrize("family", BLOCK)
def test_committed_block_kv_equals_a_clean_prefill(family):
    """After a block's commit forward the cache holds exactly the keys/values a prefill of the
    clean sequence computes (the denoising steps' keys came from masked inputs)."""
    model = model_of(family)
    bl = model.block_size
    params = params_for(model, "block_kv")
    canvas = Canvas.build([[1, 2, 3] + list(range(4, 4 + bl))], params, model.mask_token_id, model.pad_token_id, True, "cpu")
    S = canvas.x.shape[1]
    lo, hi = canvas.blocks[0]
    cache = KVCache(model.config, 1, S, torch.float64, "cpu")
    model.window_hidden(canvas.x[:, :lo], torch.arange(lo), canvas.attn, canvas.pos, lo, cache)
    # a denoising step on the partially masked block, then the block is finished and committed
    model.window_hidden(canvas.x[:, lo:hi], torch.arange(lo, hi), canvas.attn, canvas.pos, hi, cache)
    canvas.x[:, lo:hi] = torch.arange(20, 20 + bl)
    model.window_hidden(canvas.x[:, lo:hi], torch.arange(lo, hi), canvas.attn, canvas.pos, hi, cache)
    clean = KVCache(model.config, 1, S, torch.float64, "cpu")
    model.window_hidden(canvas.x[:, :hi], torch.arange(hi), canvas.attn, canvas.pos, hi, clean)
    for k, k_ref, v, v_ref in zip(cache.k, clean.k, cache.v, clean.v):
        torch.testing.assert_close(k[:, :, :hi], k_ref[:, :, :hi], atol=1e-5, rtol=0)
        torch.testing.assert_close(v[:, :, :hi], v_ref[:, :, :hi], atol=1e-5, rtol=0)


def test_cache_that_does_not_fit_the_family_is_refused():
    with pytest.raises(ValueError, match="use none or block_kv"):
        generate(model_of("sdar"), PROMPTS, params_for(model_of("sdar"), "dual"))
    with pytest.raises(ValueError, match="use none, prefix or dual"):
        generate(model_of("llada"), PROMPTS, params_for(model_of("llada"), "block_kv"))
    with pytest.raises(ValueError, match="trained with blocks of 4"):
        generate(model_of("sdar"), PROMPTS, SamplingParams(gen_length=16, steps=16, block_length=8))


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_classifier_free_guidance_with_and_without_cache(family):
    model = model_of(family)
    caches = ["none", "block_kv"] if model.block_size else ["none", "dual"]
    outs = []
    for cache in caches:
        kw = {"refresh_every": 1} if cache == "dual" else {}
        outs.append(generate(model, PROMPTS, params_for(model, cache, cfg_scale=1.5, **kw)))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].nfe % 2 == 0
    plain = generate(model, PROMPTS, params_for(model, "none"))
    assert not torch.equal(plain.sequences, outs[0].sequences)
