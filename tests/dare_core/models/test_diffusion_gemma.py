"""DiffusionGemma's network (dare_core/models/diffusion_gemma.py over gemma4.py) against the
reference modeling code in transformers, on a tiny random MoE config in float32: the same weights
loaded from the folder the reference saves, the same canvas logits from one pass of the stack as
from the reference's encoder (prompt into a KV cache) and decoder (canvas over the cache), with and
without self-conditioning, with a prompt longer than the sliding window, and for a second block
after a committed first one. Every 1-D weight and every layer scalar is drawn away from its init,
so that a weight or a scalar read from the wrong place shows."""
import json

import pytest
import torch

from dare_core.diffusion.seeding import generator
from dare_core.models.diffusion_gemma import DiffusionGemmaNet, config_from_hf, stream_masks, tiny_config
from dare_core.models.hf_folder import load_model
from diffusion_gemma_reference import saved_reference

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOL = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(reference model, our net loaded from the folder the reference saved)."""
    ref, folder = saved_reference(tmp_path_factory.mktemp("diffusion_gemma"))
    return ref, load_model(folder).net.eval()


def _tokens(shape, seed):
    return torch.randint(0, 64, shape, generator=generator(seed, "diffusion-gemma-tokens"))


def test_the_config_names_each_layers_attention():
    cfg = config_from_hf(tiny_config(64, eos_token_id=1))
    sliding, full = cfg.layers[0], cfg.layers[2]
    assert sliding.sliding and not sliding.keys_are_values and sliding.head_dim == 16 and sliding.rope_fraction == 1.0
    assert not full.sliding and full.keys_are_values and full.head_dim == 32 and full.rope_fraction == 0.25


@pytest.mark.parametrize("self_conditioning", [False, True])
def test_canvas_logits_equal_the_reference_encoder_and_decoder(pair, self_conditioning):
    ref, net = pair
    prompt, canvas = _tokens((2, 11), 0), _tokens((2, 8), 1)  # 11 prompt tokens > the sliding window of 6
    previous = 3 * torch.randn(2, 8, 64, generator=generator(2, "diffusion-gemma-logits")) if self_conditioning else None
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=previous).logits
        got = net.canvas_logits(prompt, canvas, previous)
        unconditioned = net.canvas_logits(prompt, canvas)
    torch.testing.assert_close(got, expected, **TOL)
    if self_conditioning:
        assert (got - unconditioned).abs().max() > 0.05  # the previous logits were read


def test_a_second_block_after_a_committed_one(pair):
    """The encoder appends a committed block to its cache (causally, its sliding layers keeping the
    last window - 1 tokens); the next canvas reads the cache. One pass: prompt and first block clean,
    the second canvas noisy, its block starting after them."""
    ref, net = pair
    prompt, block, canvas = _tokens((2, 9), 3), _tokens((2, 8), 4), _tokens((2, 8), 5)
    with torch.no_grad():
        first = ref(input_ids=prompt, decoder_input_ids=block)
        expected = ref(input_ids=block, past_key_values=first.past_key_values, decoder_input_ids=canvas).logits
        ids = torch.cat([prompt, block, canvas], dim=1)
        clean = torch.arange(ids.shape[1]) < 17
        clean = clean.expand(2, -1)
        pos = torch.arange(ids.shape[1]).expand(2, -1)
        got = net.logits(net(ids, clean, pos, torch.full_like(ids, 17))[:, 17:])
    torch.testing.assert_close(got, expected, **TOL)


def test_stream_masks_by_hand():
    # 3 clean tokens (positions 0-2), a block of 2 noisy tokens starting at 3; window 2
    pos = torch.tensor([[0, 1, 2, 3, 4]])
    clean = torch.tensor([[True, True, True, False, False]])
    start = torch.tensor([[0, 0, 0, 3, 3]])
    full = stream_masks(pos, clean, start, None)[0, 0].int().tolist()
    assert full == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    sliding = stream_masks(pos, clean, start, 2)[0, 0].int().tolist()
    assert sliding == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]


def test_a_checkpoint_with_an_unknown_or_a_missing_tensor_is_refused(pair, tmp_path):
    """The vision tower and the encoder's tied copies are skipped by name; any other tensor the
    family does not know, and one it lacks, is refused by name."""
    import shutil

    from dare_core.errors import ModelLoadError

    ref, _ = pair
    ref.save_pretrained(tmp_path / "ref")
    state = safetensors_torch.load_file(tmp_path / "ref" / "model.safetensors")
    for name, change, message in (("extra", {"model.decoder.bogus.weight": torch.zeros(2)}, "unexpected parameter 'model.decoder.bogus.weight'"),
                                  ("lacking", {"model.decoder.norm.weight": None}, "lacks parameter 'model.decoder.norm.weight'")):
        shutil.copytree(tmp_path / "ref", tmp_path / name)
        edited = {k: v for k, v in {**state, **change}.items() if v is not None}
        safetensors_torch.save_file(edited, tmp_path / name / "model.safetensors")
        with pytest.raises(ModelLoadError, match=message):
            load_model(tmp_path / name)


def test_a_sharded_folder_loads_as_it_is_downloaded(pair, tmp_path):
    """The reference's own sharded save (an index and several files, the vision tower among them):
    built on the meta device and assigned; the same logits as the reference, in bf16 when asked."""
    from dare_core.errors import ModelLoadError
    from dare_core.models.hf_folder import load_model

    ref, _ = pair
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    model = load_model(tmp_path / "sharded")
    net = model.net.eval()
    assert (model.mask_token_id, model.eos_token_id, model.pad_token_id) == (None, 1, 0)
    assert not any(t.is_meta for t in net.state_dict().values())
    prompt, canvas = _tokens((2, 9), 14), _tokens((2, 8), 15)
    with torch.no_grad():
        torch.testing.assert_close(net.canvas_logits(prompt, canvas), ref(input_ids=prompt, decoder_input_ids=canvas).logits, **TOL)
    assert load_model(tmp_path / "sharded", dtype=torch.bfloat16).net.embed.weight.dtype == torch.bfloat16
    shard = tmp_path / "sharded" / index["weight_map"]["model.decoder.norm.weight"]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="is missing"):
        load_model(tmp_path / "sharded")


def test_decoding_over_the_encoder_cache_equals_one_pass(pair):
    """The prompt encoded into an `EncoderCache`, then a canvas decoded over it, a block committed
    (encoded) and the next canvas decoded: the same logits as one pass of everything, also for a
    batch whose prompts differ in length (left padding, positions from each prompt's first token)."""
    from dare_core.models.gemma4 import EncoderCache
    from dare_core.models.transformer import default_position_ids

    _, net = pair
    prompts = [_tokens((1, 11), 6)[0], _tokens((1, 7), 7)[0]]
    canvas1, block1, canvas2 = _tokens((2, 8), 8), _tokens((2, 8), 9), _tokens((2, 8), 10)
    previous = 3 * torch.randn(2, 8, 64, generator=generator(11, "diffusion-gemma-logits"))
    ids = torch.zeros(2, 11, dtype=torch.long)
    attn = torch.zeros(2, 11, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 11 - len(p):], attn[i, 11 - len(p):] = p, 1
    pos = default_position_ids(ids, attn)
    lens = attn.sum(-1, keepdim=True)
    with torch.no_grad():
        cache = EncoderCache(len(net.layers))
        net.encode(cache, ids, pos, attn)
        first = net.decode(cache, canvas1, lens + torch.arange(8), previous)
        net.encode(cache, block1, lens + torch.arange(8), torch.ones_like(block1))
        second = net.decode(cache, canvas2, lens + 8 + torch.arange(8))
        for i, p in enumerate(prompts):
            torch.testing.assert_close(first[i], net.canvas_logits(p[None], canvas1[i:i + 1], previous[i:i + 1])[0], **TOL)
            context = torch.cat([p, block1[i]])[None]
            torch.testing.assert_close(second[i], net.canvas_logits(context, canvas2[i:i + 1])[0], **TOL)


def test_lora_all_linear_adapts_attention_the_mlp_and_every_expert():
    """LoRA "all-linear" reaches the stacked experts too (per expert, through peft's parameter
    targets): unchanged logits at init, gradients on the adapters only, and the merged export
    (`merged_tensors`) loaded into a plain net gives the adapted net's logits."""
    import types

    from dare_core.models.lora import LoraSettings, apply_lora, merged_tensors

    cfg = config_from_hf(tiny_config(64, eos_token_id=1))
    torch.manual_seed(3)
    net = DiffusionGemmaNet(cfg).double().eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(std=0.2)
    prompt, canvas = _tokens((2, 5), 12), _tokens((2, 8), 13)
    before = net.canvas_logits(prompt, canvas).detach()
    apply_lora(types.SimpleNamespace(net=net), LoraSettings(r=2, alpha=4), generator(5, "lora"))
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for part in ("attn.q_proj", "attn.o_proj", "mlp.down_proj", "experts"):
        assert any(f"layers.2.{part}" in n for n in trainable), part
    torch.testing.assert_close(net.canvas_logits(prompt, canvas), before, rtol=0, atol=0)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.3, generator=generator(6, n))
    adapted = net.canvas_logits(prompt, canvas)
    assert (adapted - before).abs().max() > 1e-3
    adapted.sum().backward()
    assert all(p.grad is None for n, p in net.named_parameters() if "lora_" not in n)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in net.named_parameters() if "experts" in n and "lora_" in n)
    merged = dict(merged_tensors(net))
    plain = DiffusionGemmaNet(cfg).double().eval()
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain.canvas_logits(prompt, canvas), adapted.detach(), rtol=1e-9, atol=1e-9)


def test_an_export_loads_back_bit_for_bit_and_in_the_reference(pair, tmp_path):
    """DARE's export of a DiffusionGemma (save_model: the decoder's weights and both streams' layer
    scalars, the encoder's tied copies left to the reference's tying) reloads with the same logits
    bit for bit, and transformers' from_pretrained reads it as the model it is."""
    import transformers

    from dare_core.models.hf_folder import load_model, save_model

    import tiny_models

    model = tiny_models.tiny("diffusion_gemma", seed=3)
    save_model(model, tmp_path / "export")
    again = load_model(tmp_path / "export").eval()
    prompt, canvas = _tokens((2, 9), 16), _tokens((2, 8), 17)
    with torch.no_grad():
        ours = model.net.canvas_logits(prompt, canvas)
        assert torch.equal(again.net.canvas_logits(prompt, canvas), ours)
        ref = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "export").eval()
        torch.testing.assert_close(ref(input_ids=prompt, decoder_input_ids=canvas).logits, ours, **TOL)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    import tiny_models
    from dare_core.diffusion.seeding import sample_generators
    from dare_core.diffusion.uniform import canvas_batch, canvas_sft_loss, draw

    grads = []
    for on in (False, True):
        model = tiny_models.tiny("diffusion_gemma", seed=5).double().train()
        model.set_gradient_checkpointing(on)
        batch = canvas_batch([[5, 6, 7], [9]], [[10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21]], 8, 1, 0)
        loss, _ = canvas_sft_loss(model.net, batch, draw(batch, 64, sample_generators((0, "ckpt"), ["a", "b"]), 0.5))
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.net.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
