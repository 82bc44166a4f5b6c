"""Sampler on the GPU: caches and CUDA-graph replay decode exactly what the eager loop decodes."""
import pytest
import torch

from dare_core.diffusion.seeding import sample_generators
from dare_core.sampling.decode import generate
from dare_core.sampling.params import SamplingParams
from tiny_models import tiny

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16, 17, 18]]


@pytest.mark.parametrize("family,cache,compiled", [("llada", "dual", False), ("Dream", "dual", False), ("sdar", "block_kv", False),
                                                   ("llada", "dual", True), ("sdar", "block_kv", True)])
def test_cuda_graph_replay_equals_eager(family, cache, compiled):
    model = tiny(family).double().cuda()
    bl = model.block_size or 4
    base = dict(gen_length=4 * bl, steps=4 * bl, block_length=bl, cache=cache, stop_at_eos=True, stop_token_ids=[7])
    eager = generate(model, PROMPTS, SamplingParams(**base, cuda_graphs=False), record="steps")
    graph = generate(model, PROMPTS, SamplingParams(**base, cuda_graphs=True, compile_forward=compiled), record="steps")
    assert torch.equal(eager.sequences, graph.sequences)
    assert torch.equal(eager.trajectory.step_map, graph.trajectory.step_map)


@pytest.mark.parametrize("family,cache", [("sdar", "block_kv"), ("llada2_moe", "block_kv"), ("llada", "dual")])
def test_token_editing_under_cuda_graphs_equals_eager(family, cache):
    """Token editing (docs/sampling.md#token-editing) keeps rows in a CUDA-graph batch until their block
    settles: the graph replay decodes, edits and records what the eager loop does."""
    model = tiny(family).double().cuda()
    bl = model.block_size or 4
    base = dict(gen_length=2 * bl, steps=2 * bl, block_length=bl, cache=cache, refresh_every=1 if cache == "dual" else 0,
                unmasking="threshold", threshold=0.5, edit_threshold=0.0, post_edit_steps=3, stop_token_ids=[7])
    eager = generate(model, PROMPTS, SamplingParams(**base, cuda_graphs=False), record="steps")
    graph = generate(model, PROMPTS, SamplingParams(**base, cuda_graphs=True), record="steps")
    assert eager.trajectory.edit_steps is not None and (eager.trajectory.edit_steps > 0).any()
    assert torch.equal(eager.sequences, graph.sequences) and torch.equal(eager.steps, graph.steps)
    assert torch.equal(eager.trajectory.edit_steps, graph.trajectory.edit_steps)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_gpu_cache_modes_match_cpu_float64(family):
    model = tiny(family).double()
    bl = model.block_size or 4
    cache = "block_kv" if model.block_size else "dual"
    params = SamplingParams(gen_length=4 * bl, steps=4 * bl, block_length=bl, cache=cache, refresh_every=1 if cache == "dual" else 0,
                            temperature=0.7, top_k=10)
    uids = [str(i) for i in range(len(PROMPTS))]
    cpu = generate(model, PROMPTS, params, generators=sample_generators((0,), uids))
    gpu_plain = generate(model.cuda(), PROMPTS, SamplingParams(**{**params.__dict__, "cache": "none"}),
                         generators=sample_generators((0,), uids, device="cuda"))
    gpu = generate(model, PROMPTS, params, generators=sample_generators((0,), uids, device="cuda"))
    assert torch.equal(gpu.sequences, gpu_plain.sequences)
    assert cpu.sequences.shape == gpu.sequences.shape


def test_graphs_are_reused_across_calls_and_prompt_lengths():
    model = tiny("llada").double().cuda()
    params = SamplingParams(gen_length=8, steps=8, block_length=4, cache="dual", cuda_graphs=True)
    first = generate(model, PROMPTS, params)
    graphs = dict(model._dare_graph_store.graphed.graphs)
    shorter = [p[:2] for p in PROMPTS]  # another prompt width, the same 64-column canvas bucket
    generate(model, shorter, params)
    again = generate(model, PROMPTS, params)
    assert model._dare_graph_store.graphed.graphs == graphs
    assert torch.equal(first.sequences, again.sequences)


def test_lora_merged_rollouts_capture_their_own_graphs():
    """Graphs captured with the adapters folded in run no adapter kernels: replaying them unfolded (or
    the other way round) would decode another policy. Each mode decodes what eager decoding does."""
    from dare_core.models.lora import LoraSettings, apply_lora, lora_layers

    model = apply_lora(tiny("llada").double().cuda(), LoraSettings(r=4, alpha=8))
    for i, layer in enumerate(lora_layers(model.net)):
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.2, generator=torch.Generator("cuda").manual_seed(i))
    params = SamplingParams(gen_length=8, steps=8, block_length=4, cache="dual", cuda_graphs=True)
    eager = generate(model, PROMPTS, SamplingParams(**{**params.__dict__, "cuda_graphs": False}))
    for merged in (False, True, False, True):
        out = generate(model, PROMPTS, SamplingParams(**{**params.__dict__, "lora_merged": merged}))
        assert torch.equal(out.sequences, eager.sequences), merged
