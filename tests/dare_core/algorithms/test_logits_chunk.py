"""Logits-free scoring (`model.logits_chunk` > 0) equals the whole-logits path: the per-token
log-probs and entropies and their gradients, for every family (Dream's shifted logits, the SDAR
two-stream layout, MoE families), padded and packed, and the loss and gradients of the estimators
that score: the SFT loss, d1 with KL to the reference and the entropy bonus, CJ-GRPO's replayed
trajectory scores (separable backward), EBPO's proxy-gradient replay and VRPO against its
reference's ELBOs. Float64 models, so the only differences are the float32 log-softmax of the
convention and the order of the per-chunk weight-gradient sums."""
import copy

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.algorithms.preference import build_preference
from dare_core.algorithms.registry import build_options, get_sft_objective
from dare_core.config import ModelConfig, PreferenceConfig, RLConfig
from dare_core.data.batching import pair_batch, sft_batch
from dare_core.diffusion.likelihood import head_scores, logits_scores, token_logprobs
from dare_core.diffusion.masking import Corruption
from dare_core.diffusion.seeding import generator, sample_generators
from rl_reference import grads
from rollout_helpers import rollout_batch, sampler_for
from tiny_models import FAMILIES, MASK, tiny

CHUNK = 3  # scored tokens per chunk: several chunks and a remainder in every test batch


def _model(family: str, chunk: int, packing: str = "off", frozen_head: bool = False):
    model = tiny(family).double().train()
    model.logits_chunk, model.packing = chunk, packing
    if frozen_head:  # as under LoRA, which never adapts the head: the chunks' gradients are formed in the forward
        model.net.lm_head.requires_grad_(False)
    return model


def _same_loss_and_grads(run, family: str, packing: str = "off", frozen_head: bool = False):
    """run(model) -> loss (backward done inside): the same with whole and chunked logits."""
    losses, gradients = [], []
    for chunk in (0, CHUNK):
        model = _model(family, chunk, packing, frozen_head)
        losses.append(float(run(model).detach()))
        gradients.append(grads(model))
    assert gradients[0].abs().sum() > 0, "no gradient: the test would prove nothing"
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-9)
    scale = gradients[0].abs().max().item()
    torch.testing.assert_close(gradients[1], gradients[0], rtol=0, atol=scale * 1e-6)


def test_setting_defaults_to_whole_logits_and_refuses_negative():
    assert ModelConfig().logits_chunk == 0 and tiny("llada").logits_chunk == 0
    with pytest.raises(Exception, match="logits_chunk"):
        ModelConfig(logits_chunk=-1)


def test_head_scores_hold_one_chunk_of_logits_at_a_time():
    """The head sees chunk-sized inputs only, in the forward and in the backward's recomputation."""
    head = torch.nn.Linear(4, 11, bias=False).double()
    seen = []
    head.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    hidden = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    logp, ent = head_scores(head, hidden, torch.arange(10) % 11, 4, entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert sorted(seen) == [2, 2, 4, 4, 4, 4]  # three chunks, each run again in the backward
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


class _CountLogits(torch.overrides.TorchFunctionMode):
    """The rows of every head projection (F.linear) run under it."""

    def __enter__(self):
        self.rows = []
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("pieces", [None, 4])
def test_a_frozen_head_runs_once_per_chunk_with_the_whole_logits_gradient(pieces):
    """A frozen head (LoRA's) forms each chunk's gradient rows in the forward: no recomputation in
    the backward, and the scores and the hidden states' gradient of the whole-logits path, with a
    bias, a temperature, an excluded id and the entropy."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(4, 11).double().requires_grad_(False)
    hidden = torch.randn(10, 4, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 10, (10,), generator=g)  # never 10, the excluded id
    weights = torch.randn(2, 10, dtype=torch.float64, generator=g)
    results = []
    for chunked in (False, True):
        h = hidden.clone().requires_grad_(True)
        with _CountLogits() as forward:
            logp, ent = (head_scores(head, h, targets, 4, 0.7, (10,), True, pieces) if chunked
                         else logits_scores(head(h), targets, 0.7, (10,), True))
        with _CountLogits() as backward:
            ((logp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
        results.append((logp.detach(), ent.detach(), h.grad))
    assert forward.rows == ([4, 4, 2] if pieces is None else [3, 3, 2, 2]) and backward.rows == []
    for whole, chunked in zip(*results):  # (the convention's log-softmax is float32 in both)
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frozen_head", [False, True], ids=["head-trained", "head-frozen"])
@pytest.mark.parametrize("packing", ["off", "on"])
@pytest.mark.parametrize("family", FAMILIES)
def test_token_scores_and_gradients(family, packing, frozen_head):
    """Tempered scores with MASK excluded and the entropy (the replay convention), left padding."""
    g = generator(0, "chunk-ids")
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :3] = mask[2, :1] = 0
    clean = torch.randint(0, 60, mask.shape, generator=g)
    scored = mask.bool() & (torch.rand(mask.shape, generator=g) < 0.6)
    corruption = Corruption(clean.masked_fill(scored, MASK), scored, torch.full((3,), 0.6, dtype=torch.float64))
    weights = torch.rand(2, *mask.shape, generator=g, dtype=torch.float64)
    values = []

    def run(model):
        logp, ent = token_logprobs(model, corruption, clean, mask, temperature=0.7, exclude=(MASK,), entropy=True)
        values.append((logp.detach(), ent.detach()))
        loss = (logp * weights[0]).sum() + (ent * weights[1]).sum()
        loss.backward()
        return loss

    _same_loss_and_grads(run, family, packing, frozen_head)
    for whole, chunked in zip(values[0], values[1]):
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_loss(family):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    responses, uids = [[10, 11, 12], [13], [14, 15]], ["a", "b", "c"]

    def run(model):
        batch = sft_batch(prompts, responses, uids, 6, model.eos_token_id, model.pad_token_id, eos_padding=model.block_size is None)
        cls = get_sft_objective("sft")
        algo = cls(build_options(cls, {}, "sft"), model.mask_token_id)
        out = algo.loss(model, batch, sample_generators((0, "sft", 0), uids), len(uids))
        out.loss.backward()
        return out.loss

    _same_loss_and_grads(run, family)


def _rl_run(name: str, family: str, rl: RLConfig, **options):
    """One RL update, old and reference scores from the same model (the reference a bit off)."""
    batch, _ = rollout_batch(tiny(family), rl.sampler, n=4)

    def run(model):
        algo = make_algo(name, model, rl, **options)
        b = copy.deepcopy(batch)
        cs = algo.corrupt(b, (0, 0, 0))
        with torch.no_grad():
            old = algo.score(model, b, cs)
        return run_update(algo, model, b, cs, old * 1.01, old * 0.9).loss

    return run


@pytest.mark.parametrize("frozen_head", [False, True], ids=["head-trained", "head-frozen"])
@pytest.mark.parametrize("family", FAMILIES)
def test_d1_with_kl_and_entropy(family, frozen_head):
    model = tiny(family)  # one block of generation whatever the family's block size, in 8 steps
    sampler = sampler_for(model, gen_length=max(8, model.block_size or 0), steps=8)
    rl = RLConfig(rows_per_forward=2, sampler=sampler, kl_beta=0.1, entropy_coeff=0.01)
    _same_loss_and_grads(_rl_run("d1", family, rl), family, frozen_head=frozen_head)


@pytest.mark.parametrize("family", ["llada", "Dream"])
def test_cj_grpo_replay(family):
    rl = RLConfig(rows_per_forward=2, sampler=sampler_for(tiny(family), temperature=0.8), kl_beta=0.1)
    _same_loss_and_grads(_rl_run("cj_grpo", family, rl), family, packing="on")


@pytest.mark.parametrize("family", ["sdar", "llada_moe"])
def test_ebpo_proxy_gradient(family):
    rl = RLConfig(rows_per_forward=1, sampler=sampler_for(tiny(family)), kl_beta=0.1)
    _same_loss_and_grads(_rl_run("ebpo", family, rl, mc_num=2), family)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_vrpo_against_reference(family):
    def run(model):
        obj = build_preference(PreferenceConfig(algorithm="vrpo", pad_to=4, mc_num=2), model)
        batch = pair_batch([[1, 2, 3], [4, 5]], [[20, 21], [22]], [[23], [24, 25]], ["p", "q"], 4,
                           model.eos_token_id, model.pad_token_id)
        reference = tiny(family, seed=1).double()
        reference.logits_chunk = model.logits_chunk
        corruption = obj.corrupt(batch, (0, 0))
        out = obj.update(model, batch, corruption, obj.reference_elbos(reference, batch, corruption), 2, lambda loss: loss.backward())
        return out.loss

    _same_loss_and_grads(run, family)
