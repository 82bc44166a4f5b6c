"""Rollouts that stop early cost only their tokens: on block diffusion, d1's batch leaves out the
canvas after each rollout's stop-token block (`through_stop_block`), and its scores, loss and
gradients equal those over the whole canvas, padded and packed. On masked diffusion every position
sees the whole canvas, so nothing is left out there."""
import copy

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.batch import Batch
from dare_core.config import RLConfig
from dare_core.diffusion.block import through_stop_block
from dare_core.diffusion.seeding import generator
from rl_reference import grads
from tiny_models import EOS, tiny

PROMPT_LENS = [3, 7, 5, 1, 6, 4]
STOPS = [2, 9, None, 0, 14, 5]  # the stop token's place in a response of 4 blocks of 4 (None: runs to the end)


def _batch(block: int) -> tuple[Batch, torch.Tensor]:
    """Left-padded prompts of different lengths, responses of 4 blocks with a stop token at STOPS
    (scaled to the block) and EOS after it (as every engine returns them), valid up to and
    including the stop."""
    g = generator(3, "after-stop")
    L = 4 * block
    P = max(PROMPT_LENS)
    ids = torch.zeros(len(PROMPT_LENS), P + L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    lengths = []
    for i, (n, stop) in enumerate(zip(PROMPT_LENS, STOPS)):
        stop = None if stop is None else stop * block // 4
        ids[i, P - n:] = torch.randint(0, 60, (n + L,), generator=g)
        mask[i, P - n:] = 1
        if stop is not None:
            ids[i, P + stop:] = EOS
        lengths.append(L if stop is None else stop + 1)
    lengths = torch.tensor(lengths)
    valid = torch.arange(L)[None] < lengths[:, None]
    advantages = torch.linspace(-1.0, 1.2, len(PROMPT_LENS), dtype=torch.float64)
    return Batch(ids, mask, P, valid, [f"s{i}" for i in range(len(PROMPT_LENS))], advantages), lengths


def test_keeps_the_stop_tokens_block_by_position():
    # block 4; row 0: prompt of 2 (positions 0-1), stop at response index 3 (position 5): blocks 0-1 kept
    # row 1: prompt of 4, no stop: all kept; row 2: prompt of 1, stop at index 0 (position 1): block 0 kept
    mask = torch.tensor([[0, 0, 1, 1] + [1] * 8, [1, 1, 1, 1] + [1] * 8, [0, 0, 0, 1] + [1] * 8])
    kept = through_stop_block(mask, 4, torch.tensor([4, 8, 1]), 4)
    assert kept.tolist() == [[0, 0, 1, 1] + [1] * 6 + [0, 0], [1] * 12, [0, 0, 0, 1] + [1] * 3 + [0] * 5]
    assert kept.dtype == mask.dtype


@pytest.mark.parametrize("family", ["sdar", "sdar_moe", "llada2_moe"])
@pytest.mark.parametrize("packing", ["off", "on"])
def test_d1_scores_loss_and_gradients_without_the_canvas_after_the_stop(family, packing):
    batch, lengths = _batch(tiny(family).block_size)
    results = []
    for trim in (False, True):
        model = tiny(family).double().train()
        model.packing = packing
        b = copy.deepcopy(batch)
        if trim:
            b.attention_mask = through_stop_block(b.attention_mask, b.prompt_len, lengths, model.block_size)
            assert b.attention_mask.sum() < batch.attention_mask.sum() - 20, "nothing left out: the test would prove nothing"
        algo = make_algo("d1", model, RLConfig(kl_beta=0.1))
        assert algo.trims_after_stop
        cs = algo.corrupt(b, (0, 0, 0))
        with torch.no_grad():
            old = algo.score(model, b, cs)
        out = run_update(algo, model, b, cs, old * 1.01, old * 0.9)
        results.append((old, float(out.loss), grads(model)))
    (s_full, loss_full, g_full), (s_trim, loss_trim, g_trim) = results
    assert g_full.abs().sum() > 0
    moe = "moe" in family  # routers run in float32 inside a float64 model
    tol = 1e-6 if moe else 1e-9
    torch.testing.assert_close(s_trim, s_full, rtol=tol, atol=tol)
    torch.testing.assert_close(loss_trim, loss_full, rtol=tol, atol=0)
    torch.testing.assert_close(g_trim, g_full, rtol=0, atol=g_full.abs().max().item() * tol)


def test_masked_families_and_other_objectives_keep_the_canvas():
    """LLaDA attends over the whole canvas (the EOS after a stop is context for every position);
    an objective that does not declare `scores_within_stop` keeps it on every family."""
    assert not make_algo("d1", tiny("llada")).trims_after_stop
    assert not make_algo("coupled_grpo", tiny("llada")).trims_after_stop
    assert make_algo("d1", tiny("sdar")).trims_after_stop
    assert not make_algo("bgpo", tiny("sdar"), mc_num=2).trims_after_stop
