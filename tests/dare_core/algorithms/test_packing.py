"""Packed training forwards (`model.packing`) equal padded ones: the same logits for every family
(also with holes in the mask and the block-diffusion two-stream layout), and the same loss and the
same gradients for SFT, VRPO and the RL algorithms, on batches whose prompts and responses have
different lengths. Float64 models on CPU (packed = SDPA with a block-diagonal mask), so that only
the order of floating-point sums may differ."""
import copy

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.algorithms.preference import build_preference
from dare_core.algorithms.registry import build_options, get_rl_algorithm, get_sft_objective
from dare_core.batch import Batch
from dare_core.config import PreferenceConfig, RLConfig, SamplerConfig
from dare_core.data.batching import pair_batch, sft_batch
from dare_core.diffusion.block import two_stream_logits
from dare_core.diffusion.masking import valid_region
from dare_core.diffusion.seeding import generator, sample_generators
from dare_core.models.packing import PackedLayout, packed_backend
from dare_core.sampling.decode import generate
from rl_reference import grads
from rollout_helpers import sampler_for
from tiny_models import FAMILIES, tiny

PROMPT_LENS = [2, 7, 4, 9, 1, 5]
RL_CASES = [("d1", "llada"), ("d1", "Dream"), ("d1", "sdar"), ("coupled_grpo", "llada"), ("coupled_grpo", "Dream"),
            ("bgpo", "llada"), ("bgpo", "sdar"), ("ebpo", "sdar"), ("ebpo", "sdar_moe"), ("spg", "llada"),
            ("espo", "llada"), ("cj_grpo", "llada"), ("just_grpo", "llada")]
OPTIONS = {"bgpo": {"mc_num": 3}, "ebpo": {"mc_num": 3}, "espo": {"mc_num": 2}, "spg": {"num_t": 2}}


def _model(family: str, packing: str):
    model = tiny(family).double()
    model.packing = packing
    return model


def _prompts(seed: int = 0) -> list:
    g = generator(seed, "packing-prompts")
    return [torch.randint(0, 60, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert packed_backend("off", cuda, False) is None and packed_backend("auto", cpu, False) is None
    assert packed_backend("on", cpu, True) == "sdpa" and packed_backend("auto", cuda, False) == "varlen"
    assert packed_backend("auto", cuda, True) == "flex"
    with pytest.raises(ValueError, match="model.packing"):
        packed_backend("yes", cpu, False)


def test_layout_maps_every_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 0, 1]])
    layout = PackedLayout.of(mask)
    assert layout.lens == [3, 3, 3] and layout.positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert layout.index.tolist() == [[-1, -1, 0, 1, 2], [3, 4, 5, -1, -1], [6, -1, 7, -1, 8]]
    assert layout.starts().tolist() == [0, 3, 6]


def _masks(family: str):
    """Attention masks of three layouts: left-padded prompts + a right-padded canvas, the same with
    holes (a padded forward gives a hole no position), and no padding at all."""
    B, S = len(PROMPT_LENS), 14
    left = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(PROMPT_LENS):
        left[b, 10 - n:10 + 1 + b % 4] = 1
    holes = left.clone()
    holes[0, 11], holes[3, 3] = 0, 0  # inside row 0's span / before row 3's first real token
    return {"padded": left, "holes": holes, "full": torch.ones(B, S, dtype=torch.long)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["padded", "holes", "full"])
def test_scored_logits_packed_equal_padded(family, layout):
    padded, packed = _model(family, "off"), _model(family, "on")
    if layout == "holes" and padded.family.shift_logits:
        pytest.skip("a shifted family reads the column before: a hole's garbage padded, the previous real token packed")
    mask = _masks(family)[layout]
    ids = torch.randint(0, 64, mask.shape, generator=generator(1, "ids"))
    rows = mask.bool() & (torch.rand(mask.shape, generator=generator(2, "rows")) < 0.6)
    want, got = padded.scored_logits(ids, mask, rows), packed.scored_logits(ids, mask, rows)
    assert got.shape == (int(rows.sum()), 64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", ["sdar", "sdar_moe", "llada2_moe"])
def test_two_stream_packed_equal_padded(family):
    padded, packed = _model(family, "off"), _model(family, "on")
    mask = _masks(family)["padded"]
    clean = torch.randint(0, 62, mask.shape, generator=generator(3, "clean"))
    noisy = clean.masked_fill(torch.rand(mask.shape, generator=generator(4, "noise")) < 0.5, 63)
    rows = mask.bool() & (noisy == 63)
    want = two_stream_logits(padded, noisy, clean, mask, rows)
    got = two_stream_logits(packed, noisy, clean, mask, rows)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _same_loss_and_grads(run, family: str):
    """run(model) -> loss (backward done inside); the same under packing off and on. MoE routers
    run in float32 even in a float64 model, so their families agree to float32 precision."""
    losses, gradients = [], []
    for packing in ("off", "on"):
        model = _model(family, packing).train()
        losses.append(float(run(model).detach()))
        gradients.append(grads(model))
    assert gradients[0].abs().sum() > 0, "no gradient: the test would prove nothing"
    moe = "moe" in family
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6 if moe else 1e-9, atol=0)
    scale = gradients[0].abs().max().item()
    torch.testing.assert_close(gradients[1], gradients[0], rtol=0, atol=scale * (1e-6 if moe else 1e-9))


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_loss_and_gradients(family):
    responses = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13], [14, 15, 16], []]
    uids = [f"u{i}" for i in range(len(responses))]

    def run(model):
        batch = sft_batch(_prompts(), responses, uids, 8, model.eos_token_id, model.pad_token_id,
                          eos_padding=model.block_size is None)
        cls = get_sft_objective("sft")
        algo = cls(build_options(cls, {"mask_law": "count"}, "sft"), model.mask_token_id)
        out = algo.loss(model, batch, sample_generators((0, "sft", 0), uids), len(uids))
        out.loss.backward()
        return out.loss

    _same_loss_and_grads(run, family)


@pytest.mark.parametrize("algorithm", ["vrpo", "elbo_dpo"])
def test_preference_loss_and_gradients(algorithm):
    prompts = _prompts()[:4]
    chosen, rejected = [[20, 21], [22, 23, 24], [25], [26, 27, 28]], [[20, 22], [22], [30, 31, 32], [26]]
    uids = ["p0", "p1", "p2", "p3"]

    def run(model):
        obj = build_preference(PreferenceConfig(algorithm=algorithm, pad_to=6, mc_num=3), model)
        batch = pair_batch(prompts, chosen, rejected, uids, 6, model.eos_token_id, model.pad_token_id)
        ref = copy.deepcopy(model).eval()
        with torch.no_grad():  # a policy that is no longer the reference
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator(5, "perturb"), dtype=p.dtype))
        corruption = obj.corrupt(batch, (0, 0))
        out = obj.update(model, batch, corruption, obj.reference_elbos(ref, batch, corruption), 4, lambda loss: loss.backward())
        return out.loss

    _same_loss_and_grads(run, "llada")


def _rollout(name: str, family: str):
    """A real rollout of prompts of six different lengths, as the RL loop would build it."""
    model = tiny(family)
    sampler = (SamplerConfig(gen_length=8, steps=8, block_length=1, temperature=0.7) if name == "just_grpo"
               else sampler_for(model, temperature=0.9))
    prompts = _prompts()
    uids = [f"r{i}" for i in range(len(prompts))]
    out = generate(model, prompts, sampler, sample_generators((0, "rollout"), uids), record="steps")
    P = out.prompt_len
    valid = valid_region(out.response, model.eos_token_id, out.attention_mask[:, P:])
    records = {"step_map": out.step_map, "decoded": out.trajectory.response_tokens(out.response.shape[1])}
    advantages = torch.linspace(-1.2, 1.0, len(prompts), dtype=torch.float64)
    return Batch(out.sequences, out.attention_mask, P, valid, uids, advantages, records), sampler


@pytest.mark.parametrize("name,family", RL_CASES)
def test_rl_loss_and_gradients(name, family):
    batch, sampler = _rollout(name, family)
    assert len(set(batch.attention_mask[:, :batch.prompt_len].sum(-1).tolist())) > 3, "prompts must differ in length"

    def run(model):
        rl = RLConfig(rows_per_forward=2, sampler=sampler, kl_beta=0.1 if get_rl_algorithm(name).allows_kl else 0.0)
        algo = make_algo(name, model, rl, **OPTIONS.get(name, {}))
        b = copy.deepcopy(batch)
        cs = algo.corrupt(b, (0, 0, 0))
        with torch.no_grad():
            old = algo.score(model, b, cs)
            ref = algo.score(model, b, cs) * 0.9
        return run_update(algo, model, b, cs, old * 1.01, ref).loss

    _same_loss_and_grads(run, family)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llada", "Dream", "sdar", "llada2_moe"])
def test_packed_training_on_gpu_matches_padded(family):
    """On CUDA `auto` packs (varlen, or FlexAttention for block diffusion): the SFT loss and its
    gradient match the padded batch's within bf16 precision, over batches of changing total length
    (each a new packed shape: FlexAttention must not recompile per shape or fall back to eager)."""
    responses = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13], [14, 15, 16], []]
    uids = [f"u{i}" for i in range(len(responses))]
    cls = get_sft_objective("sft")
    for shift in range(4):  # four different packed lengths
        prompts = [p + [1] * shift * (i % 3) for i, p in enumerate(_prompts())]
        results = []
        for packing in ("off", "auto"):
            model = tiny(family, wide_heads=True).to("cuda", torch.bfloat16).train()
            model.packing = packing
            batch = sft_batch(prompts, responses, uids, 8, model.eos_token_id, model.pad_token_id,
                              eos_padding=model.block_size is None)
            batch = Batch(batch.input_ids.cuda(), batch.attention_mask.cuda(), batch.prompt_len, batch.response_mask.cuda(), uids)
            algo = cls(build_options(cls, {"mask_law": "count"}, "sft"), model.mask_token_id)
            out = algo.loss(model, batch, sample_generators((0, "sft", shift), uids), len(uids))
            out.loss.backward()
            results.append((float(out.loss), grads(model).float()))
        (loss_padded, g_padded), (loss_packed, g_packed) = results
        assert abs(loss_packed - loss_padded) <= 0.02 * abs(loss_padded), (shift, loss_packed, loss_padded)
        cosine = torch.nn.functional.cosine_similarity(g_packed, g_padded, dim=0).item()
        assert cosine > 0.99, (shift, cosine)
