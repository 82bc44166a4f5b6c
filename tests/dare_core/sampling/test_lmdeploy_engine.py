"""The lmdeploy rollout engine (docs/sampling.md#engines, docs/sampling.md#rollout-records): what can be checked
without lmdeploy on CPU, and the GPU tests that run tiny SDARs through lmdeploy's own process. The checks
against lmdeploy's own code on CPU (its config builder, its model and weight loader) are in
test_lmdeploy_cpu.py."""
import sys
from pathlib import Path

import pytest
import torch

from dare_core.diffusion.seeding import generator, sample_generators
from dare_core.sampling.decode import generate
from dare_core.sampling.engines import build_engine
from dare_core.models.family import get_family
from dare_core.sampling.engines.lmdeploy import (INSTALL_HINT, assemble_output, check_model, engine_config, engine_python,
                                                 map_params, request_seeds, required_length, served_folder, session_length,
                                                 weight_buckets)
from dare_core.sampling.engines.lmdeploy.parity import compare, replay_logits
from dare_core.sampling.engines.lmdeploy.process import ALIGN, child_environment, visible_device
from dare_core.sampling.params import SamplingParams


sys.path.insert(0, "tests")
from tiny_models import MASK, VOCAB, tiny  # noqa: E402

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


def test_weight_buckets_cover_every_checkpoint_tensor_once_at_aligned_offsets():
    state = tiny("sdar").hf_state_dict()
    limit = 8192
    buckets = list(weight_buckets(state.items(), limit))
    names = [name for bucket, _, _ in buckets for name, _, _ in bucket]
    assert names == list(state) and len(names) == len(set(names))  # streamed in order, each once
    assert [last for _, _, last in buckets] == [False] * (len(buckets) - 1) + [True]
    for bucket, used, _ in buckets:
        end = 0
        for name, t, offset in bucket:
            assert t is state[name] and offset % ALIGN == 0 and offset >= end  # no overlap
            end = offset + t.numel() * t.element_size()
        assert used == end and (used <= limit or len(bucket) == 1)
    assert len(buckets) > 1
    big = {"a": torch.zeros(3000, dtype=torch.float32), "b": torch.zeros(10, dtype=torch.bfloat16)}
    assert [[n for n, _, _ in b] for b, _, _ in weight_buckets(big.items(), 1024)] == [["a"], ["b"]]  # too big: alone
    assert len(list(weight_buckets(state.items(), 2**40))) == 1
    with pytest.raises(ValueError):
        list(weight_buckets(state.items(), 0))


def test_check_model():
    check_model(tiny("sdar"))  # any mask id: the engine's process makes lmdeploy read config.json's
    check_model(tiny("sdar_moe"))
    with pytest.raises(ValueError, match="SDAR models"):
        check_model(tiny("llada"))


def test_build_engine_without_a_gpu_says_how_to_install():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(RuntimeError, match="make lmdeploy") as err:
        build_engine("lmdeploy", tiny("sdar"), model_path="unused")
    assert "CUDA" in str(err.value) and str(err.value).endswith(INSTALL_HINT)


def test_engine_python_order(monkeypatch, tmp_path):
    monkeypatch.delenv("DARE_LMDEPLOY_PYTHON", raising=False)
    assert engine_python("/opt/x/python") == "/opt/x/python"
    monkeypatch.setenv("DARE_LMDEPLOY_PYTHON", "/env/python")
    assert engine_python() == "/env/python" and engine_python("/opt/x/python") == "/opt/x/python"
    monkeypatch.delenv("DARE_LMDEPLOY_PYTHON")
    venv = Path(__file__).resolve().parents[3] / ".venv-lmdeploy" / "bin" / "python"
    assert engine_python() == (str(venv) if venv.exists() else sys.executable)


def test_child_environment_is_one_gpu_and_no_launch():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "TORCHELASTIC_RUN_ID": "x", "CUDA_VISIBLE_DEVICES": "2,3", "NCCL_NVLS_ENABLE": "0", "PATH": "/bin"}
    child = child_environment(env, visible_device(1, env))
    assert child == {"CUDA_VISIBLE_DEVICES": "3", "NCCL_NVLS_ENABLE": "0", "PATH": "/bin", "PYTHONUNBUFFERED": "1"}
    assert visible_device(1, {}) == "1" and visible_device(0, {"CUDA_VISIBLE_DEVICES": "GPU-ab, GPU-cd"}) == "GPU-ab"
    assert "CUDA_VISIBLE_DEVICES" not in child_environment({"PATH": "/bin"}, None)


def test_engine_config_has_every_field_lmdeploy_reads():
    """A DARE config leaves out keys; a bare transformers 5 config has neither pad_token_id nor a
    rope_parameters with SDAR's theta (lmdeploy would rotate with 10,000)."""
    cfg = get_family("sdar").tiny_config(VOCAB, MASK, EOS, **{"hidden_size": 32, "num_attention_heads": 4, "head_dim": 16})
    for key in ("sliding_window", "pad_token_id", "num_key_value_heads"):
        cfg.pop(key, None)
    out = engine_config(cfg | {"auto_map": {"AutoConfig": "x.Y"}}, mask_token_id=MASK, pad_token_id=PAD)
    assert "auto_map" not in out and out["mask_token_id"] == MASK and out["pad_token_id"] == PAD
    assert out["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6} and out["sliding_window"] is None
    assert out["num_key_value_heads"] == 4 and out["attention_bias"] is False and out["tie_word_embeddings"] is False
    assert {k: out[k] for k in cfg} == cfg  # nothing the config says is changed
    assert engine_config(cfg | {"pad_token_id": 7}, MASK, PAD)["pad_token_id"] == 7
    moe = engine_config(get_family("sdar_moe").tiny_config(VOCAB, MASK, EOS), MASK, PAD)
    assert moe["decoder_sparse_step"] == 1 and moe["norm_topk_prob"] is True
    with pytest.raises(ValueError, match="rope_scaling"):
        engine_config(cfg | {"rope_scaling": {"type": "yarn", "factor": 4.0}}, MASK, PAD)


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

    view = served_folder(folder, tmp_path / "view", MASK, PAD)
    with pytest.raises(ValueError):  # no remote code and a model type transformers lacks: lmdeploy's fallback
        AutoConfig.from_pretrained(view, trust_remote_code=True)
    served = PretrainedConfig.from_pretrained(view, trust_remote_code=True)
    sizes = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    assert {k: getattr(served, k) for k in sizes} == {k: config[k] for k in sizes} and "auto_map" not in served.to_dict()
    # what a bare config lacks and lmdeploy's SDAR code reads, as DARE's model has it
    assert served.pad_token_id == config["pad_token_id"] and served.mask_token_id == MASK
    assert served.rope_parameters["rope_theta"] == config["rope_theta"] and served.sliding_window is None
    tokenizer = AutoTokenizer.from_pretrained(view, trust_remote_code=True)
    assert tokenizer.convert_tokens_to_ids(["abc", "<|endoftext|>"]) == [9, 10]
    # the weights are the folder's own files, not copies
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert shards and all((view / n).resolve() == (folder / n).resolve() for n in shards)
    assert json.loads((folder / "config.json").read_text()) == config  # the user's folder is left as it was


def tiny_engine_model(tmp_path, std: float = 0.3):
    """A tiny SDAR as DARE's pipeline makes one (its character tokenizer, its ids), saved with the
    tokenizer (lmdeploy's engine loads it), bf16 on the GPU."""
    from dare_core.models.hf_folder import save_model
    from dare_core.models.lm import build_model
    from dare_core.models.tokenizer import char_tokenizer

    tok = char_tokenizer()
    cfg = get_family("sdar").tiny_config(tok.vocab_size, tok.mask_token_id, tok.eos_token_id, tok.pad_token_id,
                                         hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=64, intermediate_size=256)
    model = build_model(cfg)
    model.net.init_weights(generator(0, "lmdeploy-test"), std=std)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    tok.save(tmp_path / "tokenizer")
    save_model(model, tmp_path / "sdar", extra_files={"tokenizer": tmp_path / "tokenizer"})
    return model, tmp_path / "sdar"


@pytest.mark.gpu
def test_tiny_sdar_through_lmdeploy(tmp_path):
    """DARE's own tiny SDAR (its own vocabulary and mask id) through lmdeploy's process: the layout,
    the logits of every forward equal to DARE's on the same inputs, greedy tokens equal to our
    loop's, seeds, and weights pushed over CUDA IPC."""
    model, folder = tiny_engine_model(tmp_path)
    engine = build_engine("lmdeploy", model, model_path=str(folder), cache_max_entry_count=0.1)
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
        greedy = sdar_params(gen_length=16, steps=16)
        out = engine.generate(prompts, greedy)
        assert out.sequences.shape == (3, 5 + 16) and out.sampler["engine"] == "lmdeploy"
        assert all(1 <= n <= 16 for n in out.lengths.tolist())
        assert not (out.response == model.mask_token_id).any() and (out.response < model.config.vocab_size).all()
        for row, n in zip(out.response.tolist(), out.lengths.tolist()):
            assert row[n:] == [model.eos_token_id] * (16 - n)
        native = generate(model, prompts, greedy)
        assert (out.response.cpu() == native.response.cpu()).float().mean() >= 0.9  # a near tie may go either way

        engine.probe(True)
        for p in prompts:  # one request at a time: each record is one sequence
            engine.generate([p], greedy)
        records = engine.take_records()
        assert any(model.mask_token_id in r["input_ids"] for r in records)  # it denoised from this model's own mask id
        parity = compare(*replay_logits(model, records, torch.device("cuda")))
        assert parity["argmax_agreement_clear"] == 1.0 and parity["clear_rows"] >= 0.5 * parity["rows"], parity
        assert parity["mean_abs_err"] <= 0.02 * parity["logit_std"], parity  # bf16 both, other kernels

        sampled = sdar_params(gen_length=16, steps=16, temperature=1.0, top_k=50)  # dLLM settings as the engine started
        a = engine.generate(prompts, sampled, seeds=[1, 2, 3])
        b = engine.generate(prompts, sampled, seeds=[1, 2, 3])
        assert torch.equal(a.sequences, b.sequences)  # per-request seeds, same batch

        g = generator(1, "lmdeploy-test")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p) * 0.3)
        engine.update_weights(model)
        assert engine.last_sync["tensors"] == len(model.hf_state_dict())
        engine.take_records()
        engine.generate(prompts[:1], greedy)
        parity = compare(*replay_logits(model, engine.take_records(), torch.device("cuda")))
        assert parity["argmax_agreement_clear"] == 1.0 and parity["mean_abs_err"] <= 0.02 * parity["logit_std"], parity  # the pushed weights
    finally:
        engine.close()
    assert engine.process is None


@pytest.mark.gpu
def test_lmdeploy_process_errors_keep_their_traceback(tmp_path):
    model, folder = tiny_engine_model(tmp_path)
    engine = build_engine("lmdeploy", model, model_path=str(folder), cache_max_entry_count=0.1)
    try:
        engine.generate([[1, 2]], sdar_params())
        with pytest.raises(RuntimeError, match="Traceback") as err:
            engine.process.call("load_weights", key=99, handle=None, tensors=[], finished=True)
        assert "KeyError" in str(err.value)
        engine.process.proc.kill()
        with pytest.raises(RuntimeError, match="exited with code"):
            engine.generate([[1, 2]], sdar_params())
    finally:
        engine.close()


def test_replay_forces_dares_model_onto_a_recorded_trajectory():
    """Records made the way lmdeploy decodes (prefill of the prompt padded to whole blocks, then
    each block forwarded against the cache until clean), with DARE's own logits as lmdeploy's: the
    replay gives them back exactly. A record out of place is refused."""
    model = tiny("sdar")
    prompt, B = [1, 2, 3, 4, 5, 6], 4
    canvas = prompt + [MASK] * 2
    records = []

    def forward(history: int, ids: list[int]) -> None:
        with torch.no_grad():
            logits = model(torch.tensor([canvas[:history] + ids]))[0, -B:]
        records.append({"input_ids": list(ids), "history": [history], "seq_length": [len(ids)], "decoding": history > 0,
                        "logits": logits.to(torch.bfloat16)})

    forward(0, canvas)  # prefill: the prompt and its tail block's masks
    for start in (4, 8, 12):
        block = canvas[start:start + B] if start < len(canvas) else [MASK] * B
        canvas[start:] = block
        for i in range(B):  # commit one masked position per step, then one forward of the clean block
            if MASK in block:
                forward(start, block)
                block[block.index(MASK)] = 10 + start + i
                canvas[start:start + B] = block
        forward(start, block)
    theirs, ours = replay_logits(model, records, torch.device("cpu"))
    assert theirs.shape == ours.shape == (len(records) * B, VOCAB)
    parity = compare(theirs, ours.to(torch.bfloat16).float())
    assert parity["max_abs_err"] == 0 and parity["argmax_agreement"] == 1.0
    noisy = compare(theirs + torch.randn(theirs.shape, generator=torch.Generator().manual_seed(0)) * 0.5 * ours.std(), ours)
    assert noisy["argmax_agreement"] < 1.0 and noisy["clear_rows"] < noisy["rows"]
    assert noisy["argmax_agreement_clear"] == 1.0 or noisy["clear_rows"] == 0  # a clear gap survives any error under half of it
    with pytest.raises(ValueError, match="after 0 known tokens"):
        replay_logits(model, records[1:], torch.device("cpu"))
    with pytest.raises(ValueError, match="one request at a time"):
        replay_logits(model, [dict(records[0], history=[0, 0])], torch.device("cpu"))
