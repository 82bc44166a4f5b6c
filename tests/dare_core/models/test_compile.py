"""`model.compile`: training forwards through torch.compile give the eager loss and gradients (to
float rounding: the compiled kernels fuse and reorder sums), with and without gradient checkpointing,
packed and padded, LoRA or not; eval-mode forwards (rollouts, reference scoring) stay eager."""
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from dare_core.algorithms.registry import build_options, get_sft_objective
from dare_core.data.batching import sft_batch
from dare_core.diffusion.seeding import generator, sample_generators
from dare_core.models.lora import LoraSettings, apply_lora
from rl_reference import grads
from tiny_models import tiny

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
RESPONSES = [[3, 4, 5], [6], [7, 8, 9, 10], []]
UIDS = ["a", "b", "c", "d"]


def _loss_and_grads(family: str, compiled: bool, checkpointing: bool, packing: str, lora: bool):
    torch.manual_seed(0)
    model = tiny(family)
    if lora:  # before the cast: peft makes its adapter in the default dtype
        apply_lora(model, LoraSettings(r=4, alpha=8))
    model = model.double().train()
    if lora:
        with torch.no_grad():  # B starts at zero: make the adapter matter
            for name, p in model.net.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=generator(1, name), dtype=p.dtype))
    model.packing = packing
    model.net.compile_training = compiled
    model.set_gradient_checkpointing(checkpointing)
    batch = sft_batch(PROMPTS, RESPONSES, UIDS, 6, model.eos_token_id, model.pad_token_id,
                      eos_padding=model.block_size is None)
    cls = get_sft_objective("sft")
    algo = cls(build_options(cls, {"mask_law": "count"}, "sft"), model.mask_token_id)
    out = algo.loss(model, batch, sample_generators((0, "sft", 0), UIDS), len(UIDS))
    out.loss.backward()
    return float(out.loss.detach()), grads(model)


@pytest.mark.parametrize("family,checkpointing,packing,lora", [
    ("llada", True, "on", True), ("llada", False, "off", False), ("sdar", True, "on", False), ("Dream", False, "on", True),
])
def test_compiled_training_matches_eager(family, checkpointing, packing, lora):
    counters.clear()
    loss, g = _loss_and_grads(family, False, checkpointing, packing, lora)
    assert counters["frames"]["ok"] == 0
    loss_c, g_c = _loss_and_grads(family, True, checkpointing, packing, lora)
    assert counters["frames"]["ok"] > 0, "the compiled path did not run"
    assert g.abs().sum() > 0
    # float64 models, but the loss reads float32 log-probabilities: the loss one float32 ulp apart at
    # most; a gradient sums many terms each rounded at float32, and how Inductor vectorizes (so which
    # roundings fall where) depends on the CPU: CI's was 8.7 eps of the largest gradient apart
    # (a wrong compiled graph is apart by percents)
    f32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_c, g, rtol=0, atol=32 * f32 * g.abs().max().item())


def test_eval_forward_stays_eager():
    model = tiny("llada").double().eval()
    model.net.compile_training = True
    counters.clear()
    ids = torch.randint(0, 60, (2, 9), generator=generator(0, "ids"))
    with torch.no_grad():
        model(ids, torch.ones_like(ids))
    assert counters["frames"]["ok"] == 0


def _gpu_loss_and_grads(family: str, shift: int, dtype: torch.dtype, compiled: bool):
    model = tiny(family, wide_heads=True)
    torch.manual_seed(0)  # peft draws lora_A from the global generator: the same adapter every time
    apply_lora(model, LoraSettings(r=4, alpha=8))
    model = model.to("cuda", dtype).train()
    with torch.no_grad():
        for name, p in model.net.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator(1, name), dtype=torch.float32).to(p))
    # the float32 reference runs padded (SDPA): the varlen kernels take half precision only, and
    # padded = packed is pinned by test_packing
    model.packing, model.net.compile_training = "auto" if dtype != torch.float32 else "off", compiled
    model.set_gradient_checkpointing(True)
    prompts = [p + [1] * shift * (i % 3) for i, p in enumerate(PROMPTS)]
    batch = sft_batch(prompts, RESPONSES, UIDS, 6, model.eos_token_id, model.pad_token_id,
                      eos_padding=model.block_size is None)
    batch = dataclasses.replace(batch, input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda(),
                                response_mask=batch.response_mask.cuda())
    cls = get_sft_objective("sft")
    algo = cls(build_options(cls, {"mask_law": "count"}, "sft"), model.mask_token_id)
    out = algo.loss(model, batch, sample_generators((0, "sft", shift), UIDS), len(UIDS))
    out.loss.backward()
    return float(out.loss), grads(model).float()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_compiled_packed_training_on_gpu(family):
    """On CUDA, compiled packed training (varlen, FlexAttention for block diffusion) with LoRA and
    gradient checkpointing is as close to the float32 result as eager bf16 training is, over batches
    of changing packed length (dynamic shapes: no failure on a new length). bf16 rounding of a tiny
    random model moves the loss by a few per cent, so the yardstick is eager bf16's own error, not a
    fixed tolerance."""
    for shift in range(3):
        loss_ref, g_ref = _gpu_loss_and_grads(family, shift, torch.float32, False)
        loss, g = _gpu_loss_and_grads(family, shift, torch.bfloat16, False)
        loss_c, g_c = _gpu_loss_and_grads(family, shift, torch.bfloat16, True)
        assert abs(loss_c - loss_ref) <= 2 * abs(loss - loss_ref) + 2e-3 * abs(loss_ref), (shift, loss_c, loss, loss_ref)
        # the compiled kernels round where eager does (emulate_precision_casts): the same loss
        assert abs(loss_c - loss) <= 1e-3 * abs(loss), (shift, loss_c, loss)
        cos = lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=0).item()  # noqa: E731
        assert 1 - cos(g_c, g_ref) <= 2 * (1 - cos(g, g_ref)) + 1e-3, (shift, cos(g_c, g_ref), cos(g, g_ref))


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_compiled_cached_window_matches_eager_with_one_compilation_for_all_layers(family):
    """`compile_forward`'s window: every layer goes through one compiled layer call (compiled once per
    window shape, not once per layer), writes the same KV cache and gives the eager hidden states."""
    import torch._dynamo

    from dare_core.models.transformer import KVCache

    torch._dynamo.reset()
    model = tiny(family).double().eval()
    n = 12
    ids = torch.randint(0, 60, (2, n), generator=generator(0, "ids"))
    attn, pos = torch.ones_like(ids), torch.arange(n).expand(2, n)
    out, caches = {}, {}
    for compiled in (False, True):
        counters.clear()
        cache = KVCache(model.net.cfg, 2, n, torch.float64, "cpu")
        with torch.no_grad():
            model.window_hidden(ids, torch.arange(n), attn, pos, n, cache)  # fill the cache
            cols = torch.arange(4, 8)
            out[compiled] = model.window_hidden(ids[:, 4:8], cols, attn, pos, n, cache, compiled=compiled)
        caches[compiled] = cache.k + cache.v
        assert counters["stats"]["unique_graphs"] == (1 if compiled else 0)
    assert len(model.net.layers) > 1
    # float64 models whose RMSNorm and RoPE run in float32: fused, those sums round differently
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
    for a, b in zip(caches[True], caches[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
