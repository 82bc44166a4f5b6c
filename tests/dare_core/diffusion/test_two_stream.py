"""The block-diffusion two-stream layout: its mask is the four rules, and one pass scores every
noisy block exactly as a plain forward over [clean earlier blocks ; that noisy block] does."""
import torch

from dare_core.diffusion.block import two_stream_mask
from dare_core.diffusion.likelihood import token_logprobs
from dare_core.diffusion.masking import masked_corruption
from dare_core.diffusion.seeding import generator
from tiny_models import tiny


def test_mask_is_the_four_rules():
    S, bs = 10, 4
    pos = torch.arange(S)[None]
    m = two_stream_mask(pos, bs)[0, 0]
    blk = torch.arange(S) // bs
    for q in range(2 * S):
        for k in range(2 * S):
            bq, bk = blk[q % S], blk[k % S]
            noisy_q, noisy_k = q < S, k < S
            want = (bq == bk) if noisy_q and noisy_k else (bk < bq) if noisy_q else False if noisy_k else (bk <= bq)
            assert bool(m[q, k]) == bool(want), (q, k)


def test_two_stream_scores_equal_per_block_plain_forwards():
    model = tiny("sdar")
    mask_id = model.mask_token_id
    S, P = 14, 5  # blocks of 4: the first response block holds the prompt tail
    x = torch.randint(0, 60, (1, S), generator=generator(11, "seq"))
    attn = torch.ones_like(x)
    masked = torch.rand(1, S - P, generator=generator(12, "m")) < 0.5
    masked[0, 0] = True
    corr = masked_corruption(x, P, masked, mask_id, torch.tensor([0.5]))
    got = token_logprobs(model, corr, x, attn)
    for b in range(S // 4 + 1):
        lo, hi = 4 * b, min(4 * b + 4, S)
        rows = corr.scored[0, lo:hi]
        if not rows.any():
            continue
        # clean prefix, then this block as corrupted; the model's own block-causal attention
        inp = torch.cat([x[:, :lo], corr.noisy_ids[:, lo:hi]], dim=1)
        logp = torch.log_softmax(model(inp)[0, lo:hi].float(), -1).gather(-1, x[0, lo:hi, None]).squeeze(-1)
        torch.testing.assert_close(got[0, lo:hi][rows], logp[rows], atol=1e-5, rtol=1e-5)
