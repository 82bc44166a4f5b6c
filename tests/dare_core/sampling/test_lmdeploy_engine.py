"""The lmdeploy rollout engine (docs/sampling.md#block-diffusion-decoding pitfalls, docs/sampling.md#rollout-records): what can be checked without lmdeploy
on CPU, and one GPU test that runs a tiny SDAR through lmdeploy when it is installed."""
import sys
from types import SimpleNamespace

import pytest
import torch

from dare_core.diffusion.seeding import generator, sample_generators
from dare_core.sampling.decode import generate
from dare_core.sampling.engines import build_engine
from dare_core.models.family import get_family
from dare_core.sampling.engines.lmdeploy import (assemble_output, check_model, map_params, request_seeds, required_length,
                                                 served_folder, session_length, weight_chunks)
from dare_core.sampling.params import SamplingParams

SDAR_MASK_TOKEN = get_family("sdar").engine_mask_ids["lmdeploy"]  # the mask id lmdeploy's SDAR builder assumes

sys.path.insert(0, "tests")
from tiny_models import tiny  # noqa: E402

EOS, PAD = 62, 61


def sdar_params(**kw) -> SamplingParams:
    base = dict(gen_length=16, steps=16, block_length=4, cache="block_kv", unmasking="topk")
    return SamplingParams(**{**base, **kw})


@pytest.mark.parametrize("unmasking, strategy", [("topk", "low_confidence_static"), ("threshold", "low_confidence_dynamic"),
                                                 ("sequential", "sequential")])
def test_each_strategy_maps_to_lmdeploy(unmasking, strategy):
    engine, request = map_params(sdar_params(unmasking=unmasking, steps=8, threshold=0.8), 4, EOS)
    assert engine == {"dllm_block_length": 4, "dllm_unmasking_strategy": strategy, "dllm_denoising_steps": 2,
                      "dllm_confidence_threshold": 0.8}
    assert request["max_new_tokens"] == 16 and request["stop_token_ids"] == [EOS]


def test_request_settings():
    _, req = map_params(sdar_params(temperature=1.0, top_k=50, top_p=0.9, stop_token_ids=[7, EOS]), 4, EOS)
    assert (req["temperature"], req["top_k"], req["top_p"], req["do_sample"]) == (1.0, 50, 0.9, True)
    assert req["stop_token_ids"] == [7, EOS] and req["bad_token_ids"] is None and not req["ignore_eos"]
    _, req = map_params(sdar_params(), 4, EOS)
    assert req["top_k"] == 0 and not req["do_sample"]  # lmdeploy's default top_k is 50: always sent
    _, req = map_params(sdar_params(stop_at_eos=False, logits_eos_inf=True), 4, EOS)
    assert req["stop_token_ids"] is None and req["bad_token_ids"] == [EOS]


@pytest.mark.parametrize("kw, message", [
    ({"unmasking": "dynamic"}, "our 'threshold'"),
    ({"unmasking": "factor"}, "unmasking 'factor'"),
    ({"unmasking": "entropy_bounded"}, "unmasking 'entropy_bounded'"),
    ({"cache": "none"}, "set cache: block_kv"),
    ({"cache": "dual"}, "set cache: block_kv"),
    ({"cfg_scale": 1.0}, "classifier-free guidance"),
    ({"alg_temp": 0.5}, "alg_temp"),
    ({"confidence_eos_eot_inf": True}, "confidence_eos_eot_inf"),
    ({"schedule": "dream"}, "schedule 'dream'"),
    ({"steps": 12}, "3 steps per block of 4"),
    ({"temperature": 0.7}, "tempered"),
    ({"temperature": 1.0, "top_k": 50, "remasking": "maskgit_plus"}, "ignores the filtering"),
    ({"remasking": "topk_margin"}, "remasking 'topk_margin'"),
    ({"temperature": 2.5, "remasking": "maskgit_plus"}, "temperature 2.5"),
    ({"block_length": 8, "steps": 8}, "set block_length: 4"),
])
def test_settings_lmdeploy_cannot_honour_are_refused(kw, message):
    with pytest.raises(ValueError, match="lmdeploy|block_length") as err:
        map_params(sdar_params(**kw), 4, EOS)
    assert message in str(err.value)


def test_refuses_trajectory_recording_and_masked_diffusion():
    with pytest.raises(ValueError, match="record='steps'"):
        map_params(sdar_params(), 4, EOS, record="steps")
    with pytest.raises(ValueError, match="block-diffusion"):
        map_params(sdar_params(), None, EOS)


def test_tempered_confidence_is_fine_when_lmdeploy_matches():
    map_params(sdar_params(temperature=0.7, remasking="maskgit_plus"), 4, EOS)  # unfiltered: softmax(l/T) both
    map_params(sdar_params(temperature=1.0, top_k=50, top_p=0.95, unmasking="threshold"), 4, EOS)  # SDAR RL recipe
    map_params(sdar_params(temperature=0.7, top_k=50, unmasking="sequential"), 4, EOS)  # no confidence used


def test_session_length_covers_prompt_plus_response():
    assert required_length([3, 10], 16, 4) == 28  # 10 + 16 = 26, rounded up to whole blocks
    assert session_length(28, 64) == 64
    assert session_length(28, 64, requested=40) == 40
    with pytest.raises(ValueError, match="shorter than prompt \\+ gen_length"):
        session_length(required_length([512], 2048, 4), 32768, requested=2048)  # the reference's server
    with pytest.raises(ValueError, match="model's maximum length 64"):
        session_length(required_length([60], 16, 4), 64)
    with pytest.raises(ValueError, match="at least one token"):
        required_length([3, 0], 16, 4)


def test_request_seeds():
    assert request_seeds(2, seeds=[5, 2**40]) == [5, 2**40]
    assert request_seeds(2) == [None, None]
    a = request_seeds(3, sample_generators((0, "rollout", 1), [0, 1, 2]))
    b = request_seeds(3, sample_generators((0, "rollout", 1), [0, 1, 2]))
    assert a == b and len(set(a)) == 3 and all(0 <= s < 2**32 for s in a)
    gens = sample_generators((0, "rollout", 1), [0, 1, 2])
    assert request_seeds(3, gens) == a and request_seeds(3, gens) != a  # a generator used twice moves on
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        request_seeds(3, seeds=[1, 2])
    with pytest.raises(ValueError, match="1 generators for 2 prompts"):
        request_seeds(2, [generator(0)])


def test_assemble_output_layout():
    prompts = [[1, 2, 3], [4], [5, 6]]
    responses = [[7, 8, EOS, 9], [10, 11, 12, 13], [14, EOS]]
    out = assemble_output(prompts, responses, sdar_params(gen_length=4, steps=4), PAD, EOS, seeds=[1, 2, 3])
    assert out.prompt_len == 3
    assert out.sequences.tolist() == [[1, 2, 3, 7, 8, EOS, EOS], [PAD, PAD, 4, 10, 11, 12, 13], [PAD, 5, 6, 14, EOS, EOS, EOS]]
    assert out.attention_mask.tolist() == [[1] * 7, [0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]]
    assert out.lengths.tolist() == [3, 4, 2] and out.stop_reason == ["eos", "length", "eos"]
    assert out.steps.tolist() == [0, 0, 0] and out.trajectory is None
    assert out.sampler["engine"] == "lmdeploy" and out.sampler["seeds"] == [1, 2, 3] and out.sampler["gen_length"] == 4


def test_assemble_output_stop_ids_and_truncation():
    params = sdar_params(gen_length=4, steps=4, stop_token_ids=[11])
    out = assemble_output([[1]], [[10, 11, 12, 13]], params, PAD, EOS)
    assert out.response.tolist() == [[10, 11, EOS, EOS]] and out.lengths.tolist() == [2]
    with pytest.raises(ValueError, match="no stop token"):  # a session_len cut must not pass for a finished response
        assemble_output([[1]], [[10, 12]], params, PAD, EOS)
    with pytest.raises(ValueError, match="5 tokens"):
        assemble_output([[1]], [[10, 12, 13, 14, 15]], params, PAD, EOS)


def test_assemble_output_matches_the_native_layout():
    """Feeding the native loop's valid response ids back gives the native GenerationOutput."""
    model = tiny("sdar")
    params = sdar_params(gen_length=12, steps=12, temperature=1.0, stop_token_ids=[5, 9, 17])
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    native = generate(model, prompts, params, generators=sample_generators((0, "t"), [0, 1, 2]))
    responses = [row[:n] for row, n in zip(native.response.tolist(), native.lengths.tolist())]
    out = assemble_output(prompts, responses, params, model.pad_token_id, model.eos_token_id)
    assert torch.equal(out.sequences, native.sequences) and torch.equal(out.attention_mask, native.attention_mask)
    assert torch.equal(out.lengths, native.lengths) and out.stop_reason == native.stop_reason
    assert out.prompt_len == native.prompt_len


def test_weight_chunks_cover_every_checkpoint_tensor_once():
    state = tiny("sdar").hf_state_dict()
    limit = 8192
    chunks = weight_chunks(state, limit)
    names = [name for chunk in chunks for name, _ in chunk]
    assert sorted(names) == sorted(state) and len(names) == len(set(names))
    for chunk in chunks:
        for name, t in chunk:
            assert t.shape == state[name].shape and t is state[name]
        size = sum(t.numel() * t.element_size() for _, t in chunk)
        assert size <= limit or len(chunk) == 1
    assert len(chunks) > 1
    assert len(weight_chunks(state, 2**40)) == 1
    with pytest.raises(ValueError):
        weight_chunks(state, 0)


def test_check_model():
    with pytest.raises(ValueError, match=f"mask token id {SDAR_MASK_TOKEN}"):
        check_model(tiny("sdar"))
    with pytest.raises(ValueError, match="SDAR models"):
        check_model(tiny("llada"))
    check_model(SimpleNamespace(family=SimpleNamespace(model_type="sdar"), block_size=4, mask_token_id=SDAR_MASK_TOKEN))


def test_build_engine_without_lmdeploy_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdeploy", None)  # as if not installed, even where it is
    with pytest.raises(ImportError, match=r"pip install 'dare\[lmdeploy\]'") as err:
        build_engine("lmdeploy", tiny("sdar"), model_path="unused")
    assert "CUDA" in str(err.value)


def test_lmdeploy_reads_a_folder_dare_saved_without_its_remote_code(tmp_path):
    """lmdeploy reads config.json and tokenizer_config.json through transformers' Auto* classes with
    trust_remote_code (falling back to a plain config where AutoConfig fails). The checkpoint's auto_map
    names modules a DARE folder does not hold; the served view reads with transformers alone."""
    import json

    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

    from dare_core.models.hf_folder import save_model

    folder = tmp_path / "sdar"
    save_model(tiny("sdar"), folder)
    # a model loaded from the released checkpoint saves its config.json, auto_map included
    config = json.loads((folder / "config.json").read_text()) | {"auto_map": {
        "AutoConfig": "configuration_sdar.SDARConfig", "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}}
    (folder / "config.json").write_text(json.dumps(config))
    # the released tokenizer_config names its own tokenizer module too; a two-merge BPE vocabulary
    vocab = {c: i for i, c in enumerate("abcdefgh")} | {"ab": 8, "abc": 9, "<|endoftext|>": 10}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\na b\nab c\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_qwen2.Qwen2Tokenizer", None]}, "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 512}))
    with pytest.raises(OSError, match="configuration_sdar"):
        AutoConfig.from_pretrained(folder, trust_remote_code=True)
    with pytest.raises(OSError, match="tokenization_qwen2"):
        AutoTokenizer.from_pretrained(folder, trust_remote_code=True)

    view = served_folder(folder, tmp_path / "view")
    with pytest.raises(ValueError):  # no remote code and a model type transformers lacks: lmdeploy's fallback
        AutoConfig.from_pretrained(view, trust_remote_code=True)
    served = PretrainedConfig.from_pretrained(view, trust_remote_code=True).to_dict()
    sizes = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    assert {k: served[k] for k in sizes} == {k: config[k] for k in sizes} and "auto_map" not in served
    tokenizer = AutoTokenizer.from_pretrained(view, trust_remote_code=True)
    assert tokenizer.convert_tokens_to_ids(["abc", "<|endoftext|>"]) == [9, 10]
    # the weights are the folder's own files, not copies
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert shards and all((view / n).resolve() == (folder / n).resolve() for n in shards)
    assert json.loads((folder / "config.json").read_text()) == config  # the user's folder is left as it was


@pytest.mark.gpu
def test_tiny_sdar_through_lmdeploy(tmp_path):
    pytest.importorskip("lmdeploy")
    from dare_core.models.lm import build_model
    from dare_core.models.hf_folder import save_model

    # lmdeploy hard-codes SDAR's mask id, so the tiny model needs a vocabulary that holds it
    eos = 151643
    cfg = get_family("sdar").tiny_config(SDAR_MASK_TOKEN + 11, SDAR_MASK_TOKEN, eos, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                                         max_position_embeddings=512)
    model = build_model(cfg)
    model.net.init_weights(generator(0, "lmdeploy-test"), std=0.3)
    model = model.eval().cuda()
    save_model(model, tmp_path / "sdar")
    engine = build_engine("lmdeploy", model, model_path=str(tmp_path / "sdar"), cache_max_entry_count=0.2)
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
        greedy = sdar_params(gen_length=16, steps=16)
        out = engine.generate(prompts, greedy)
        assert out.sequences.shape == (3, 5 + 16) and out.sampler["engine"] == "lmdeploy"
        assert all(1 <= n <= 16 for n in out.lengths.tolist())
        assert not (out.response == SDAR_MASK_TOKEN).any() and (out.response < cfg["vocab_size"]).all()
        for row, n in zip(out.response.tolist(), out.lengths.tolist()):
            assert row[n:] == [eos] * (16 - n)
        # the same model decoded by our loop: greedy agrees on the first block (fp16 engine vs fp32 here)
        native = generate(model, prompts, greedy)
        assert (out.response[:, :4].cpu() == native.response[:, :4].cpu()).float().mean() >= 0.75

        sampled = sdar_params(gen_length=16, steps=16, temperature=1.0, top_k=50)  # dLLM settings as the engine started
        a = engine.generate(prompts, sampled, seeds=[1, 2, 3])
        b = engine.generate(prompts, sampled, seeds=[1, 2, 3])
        assert torch.equal(a.sequences, b.sequences)  # per-request seeds, same batch

        engine.update_weights(model)  # the weights it already has: greedy output unchanged
        assert torch.equal(engine.generate(prompts, greedy).sequences, out.sequences)
        g = generator(1, "lmdeploy-test")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.3)
        engine.update_weights(model)
        assert not torch.equal(engine.generate(prompts, greedy).sequences, out.sequences)
    finally:
        engine.close()
