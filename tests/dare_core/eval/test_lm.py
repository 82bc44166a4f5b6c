"""EvalModel: the checkpoint wrapper every benchmark runs through (no OpenCompass needed)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dare_core.eval.lm import EvalModel, sampler_settings
from eval_helpers import tiny_folder

PROMPTS = ["What is 2+3?", "Name a colour.", "x", "A much longer question about apples and pears, and how many there are?"]


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("lm"), "llada", sampler={"gen_length": 6, "steps": 6, "block_length": 6})


def test_sampler_layers_and_errors(llada, tmp_path):
    m = EvalModel(llada, sampler={"steps": 3}, device="cpu")
    assert (m.sampling_params().gen_length, m.sampling_params().steps) == (6, 3)  # checkpoint, then ours
    p = m.sampling_params({"gen_length": 8, "steps": 8, "block_length": 4, "cache": "prefix"})
    assert (p.gen_length, p.block_length, p.cache) == (8, 4, "prefix")
    with pytest.raises(ValueError, match="unknown sampler setting 'stepz'"):
        m.sampling_params({"stepz": 2})
    with pytest.raises(ValueError, match="divisible"):
        m.sampling_params({"gen_length": 7})
    sdar = EvalModel(tiny_folder(tmp_path, "sdar"), device="cpu")
    assert sdar.sampling_params({"gen_length": 8, "steps": 8}).block_length == 4  # the model's own block size
    assert sampler_settings({"gen_length": 4, "block_length": 4, "batch_size": 9}, {"steps": 2}).steps == 2


def test_steps_beyond_gen_length_only_where_the_schedule_can_use_them(llada):
    m = EvalModel(llada, device="cpu")
    with pytest.raises(ValueError, match=r"steps 12 > gen_length 6"):
        m.sampling_params({"steps": 12})
    with pytest.raises(ValueError, match=r"steps 12 > gen_length 6"):
        EvalModel(llada, sampler={"steps": 12, "unmasking": "threshold"}, device="cpu")
    # Dream's timestep grid is defined for any number of steps (a step may commit nothing)
    assert m.sampling_params({"steps": 12, "schedule": "dream"}).steps == 12
    assert m.sampling_params({"steps": 12, "unmasking": "origin"}).steps == 12


def test_settings_name_what_is_wrong(llada):
    m = EvalModel(llada, device="cpu")
    with pytest.raises(ValueError, match=r"^sampler settings: gen_length must be positive, got 0$"):
        m.sampling_params({"gen_length": 0})
    with pytest.raises(ValueError, match=r"cache 'block_kv' does not apply to a masked-diffusion model"):
        EvalModel(llada, sampler={"cache": "block_kv"}, device="cpu")
    with pytest.raises(ValueError, match=r"the prompt has \d+ tokens .* max_sequence_length 4096"):
        m.generate(["x" * 5000])


def test_render_uses_the_chat_template_for_messages_only(llada):
    m = EvalModel(llada, device="cpu")
    chat = m.render([{"role": "user", "content": "hi"}])
    assert chat == m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) and chat != "hi"
    assert m.render("raw text") == "raw text"
    plain = EvalModel(llada, chat=False, device="cpu")
    assert plain.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]) == "be brief\n\nhi"


@pytest.mark.parametrize("sampler", [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.0, "cache": "prefix",
                                                                                    "unmasking": "threshold", "block_length": 3}])
def test_generation_does_not_depend_on_batch_size_or_order(llada, sampler):
    texts = {}
    for bs in (1, 3, 8):
        m = EvalModel(llada, sampler=sampler, batch_size=bs, seed=5, device="cpu")
        texts[bs] = m.generate(PROMPTS)
    assert texts[1] == texts[3] == texts[8]
    m = EvalModel(llada, sampler=sampler, batch_size=3, seed=5, device="cpu")
    assert m.generate(PROMPTS[::-1]) == texts[1][::-1]
    if sampler["temperature"] > 0:
        assert EvalModel(llada, sampler=sampler, seed=6, device="cpu").generate(PROMPTS) != texts[1]


def _direct_logprob(m: EvalModel, context: str, token: str) -> float:
    """log p(token | context, [MASK]) from one plain forward: the exact one-token likelihood."""
    ctx = m.tokenizer.encode(context)
    tid = m.tokenizer.encode(token)
    assert len(tid) == 1
    ids = torch.tensor([ctx + [m.model.mask_token_id]])
    with torch.no_grad():
        logits = m.model(ids, attention_mask=torch.ones_like(ids))
    logits = getattr(logits, "logits", logits)
    return torch.log_softmax(logits[0, -1].float(), -1)[tid[0]].item()


def test_one_token_loglikelihood_is_exact(llada):
    m = EvalModel(llada, ll_mc_num=8, device="cpu")
    ctx = "Question: 2+2?\nAnswer:"
    got = m.loglikelihood([ctx, ctx], ["A", "B"])
    for value, tok in zip(got, "AB"):
        assert value == pytest.approx(_direct_logprob(m, ctx, tok), abs=1e-5)


def test_loglikelihood_is_reproducible_and_batch_invariant(llada, tmp_path):
    contexts = ["The cat sat on the", "Two plus two is", "Colours:"]
    conts = [" mat today", " four", " red, green and blue"]
    values = {}
    for bs in (1, 2, 6):
        m = EvalModel(llada, ll_mc_num=6, batch_size=bs, seed=1, device="cpu")
        values[bs] = m.loglikelihood(contexts, conts)
    for bs in (2, 6):
        assert values[bs] == pytest.approx(values[1], rel=1e-5, abs=1e-5)
    assert values[1] == EvalModel(llada, ll_mc_num=6, batch_size=1, seed=1, device="cpu").loglikelihood(contexts, conts)
    assert all(v < 0 and math.isfinite(v) for v in values[1])
    total = EvalModel(llada, ll_mc_num=6, ll_norm="sum", seed=1, device="cpu").loglikelihood(contexts, conts)
    n_tokens = [len(EvalModel(llada, device="cpu")._split(c, r)[1]) for c, r in zip(contexts, conts)]
    assert total == pytest.approx([v * n for v, n in zip(values[1], n_tokens)], rel=1e-5)
    sdar = EvalModel(tiny_folder(tmp_path, "sdar"), ll_mc_num=3, device="cpu")
    assert all(math.isfinite(v) for v in sdar.loglikelihood(contexts, conts))


def test_uniform_noise_loglikelihood_is_reproducible_and_batch_invariant(tmp_path):
    """DiffusionGemma's ELBO (its own, at stratified times; continuations filled with EOS to whole
    canvases): the same value in any batch and on a second run, finite and negative; and the
    family's sampler defaults decode."""
    folder = tiny_folder(tmp_path, "diffusion_gemma")
    contexts = ["The cat sat on the", "Two plus two is", "Colours:"]
    conts = [" mat today", " four", " red, green and blue"]  # (the last one longer than a canvas)
    values = {bs: EvalModel(folder, ll_mc_num=4, batch_size=bs, seed=1, device="cpu").loglikelihood(contexts, conts)
              for bs in (1, 3)}
    assert values[3] == pytest.approx(values[1], rel=1e-5, abs=1e-5)
    assert values[1] == EvalModel(folder, ll_mc_num=4, batch_size=1, seed=1, device="cpu").loglikelihood(contexts, conts)
    assert all(v < 0 and math.isfinite(v) for v in values[1])
    from dare_core.eval.lm import family_sampler_defaults

    # (as its OpenCompass class DareDiffusionGemma does: the family's defaults under the settings)
    texts = EvalModel(folder, device="cpu", defaults=family_sampler_defaults("diffusion_gemma"),
                      sampler={"gen_length": 16, "steps": 8}).generate(contexts)
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)


def test_manifest_names_what_the_numbers_depend_on(llada):
    info = EvalModel(llada, seed=3, device="cpu").manifest({"gen_length": 12, "steps": 12, "block_length": 6})
    assert info["sampler"]["gen_length"] == 12 and info["seed"] == 3 and info["device"] == "cpu"
    json.dumps(info)
