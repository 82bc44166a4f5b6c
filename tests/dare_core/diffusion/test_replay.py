"""Trajectory corruptions (docs/diffusion.md#trajectory-replay, docs/diffusion.md#exact-ar): replay rows are the sampler's own states before
each step, every committed valid token is scored exactly once; AR rows are prompt, y_<t, then MASK."""
import pytest
import torch

from dare_core.diffusion.replay import ar_rows, block_local, replay_canvas, replay_rows
from rollout_helpers import rollout_batch, sampler_for
from tiny_models import tiny

MASK = 63


def test_replay_rows_are_the_sampler_states():
    model = tiny("llada")
    sp = sampler_for(model, gen_length=8, steps=4, block_length=4, temperature=1.0)
    batch, out = rollout_batch(model, sp, n=3, record="steps")
    P = batch.prompt_len
    steps = batch.records["step_map"].long()
    decoded = batch.records["decoded"]
    targets = batch.input_ids.clone()
    targets[:, P:] = decoded
    cs = replay_rows(batch.input_ids, P, steps, batch.response_mask, MASK, targets)
    assert len(cs) == int(steps.max())
    traj = out.trajectory
    for row in range(len(batch)):
        states = list(traj.states(row))
        for k, state in enumerate(states):
            # the sampler's window is the response for masked diffusion
            assert torch.equal(cs.rows[k].noisy_ids[row, P:], state[traj.response_offset[row]:][:8])
            assert torch.equal(cs.rows[k].noisy_ids[row, :P], batch.input_ids[row, :P])
    hits = torch.stack([r.scored for r in cs.rows]).sum(0)
    assert torch.equal(hits[:, P:] == 1, batch.response_mask) and hits.max() == 1 and not hits[:, :P].any()
    for k, r in enumerate(cs.rows, start=1):
        assert torch.equal(r.scored[:, P:], (steps == k) & batch.response_mask)
        assert torch.equal(r.targets, targets)


def test_replay_keeps_the_tail_as_decoded():
    """tail_policy does not apply: tokens after the first EOS appear as the rollout had them."""
    ids = torch.tensor([[1, 2, 5, 62, 7, 8]])
    steps = torch.tensor([[2, 1, 1, 3]])
    valid = torch.tensor([[True, True, False, False]])
    cs = replay_rows(ids, 2, steps, valid, MASK)
    assert cs.rows[0].noisy_ids.tolist() == [[1, 2, MASK, MASK, MASK, MASK]]
    assert cs.rows[1].noisy_ids.tolist() == [[1, 2, MASK, 62, 7, MASK]]
    assert cs.rows[2].noisy_ids.tolist() == [[1, 2, 5, 62, 7, MASK]]
    assert not cs.rows[2].scored.any()  # the tail token of step 3 is not in V: never scored
    assert cs.rows[0].scored.tolist() == [[False, False, False, True, False, False]]
    assert cs.rows[1].scored.tolist() == [[False, False, True, False, False, False]]


def test_replay_canvas_appends_the_record_columns_past_the_response():
    """Columns of the record past the response (a block-diffusion terminal block running past
    gen_length) join the replay, attended where the sampler decoded them, padding keys elsewhere."""
    ids = torch.tensor([[0, 1, 2, 5, 6], [3, 4, 2, 7, 8]])
    attn = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    decoded = torch.tensor([[5, 6, 9, MASK], [7, 8, MASK, MASK]])
    steps = torch.tensor([[1, 2, 2, 0], [2, 1, 0, 0]])
    targets, wide = replay_canvas(ids, attn, 3, decoded, steps)
    assert targets.tolist() == [[0, 1, 2, 5, 6, 9, MASK], [3, 4, 2, 7, 8, MASK, MASK]]
    assert wide.tolist() == [[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]]
    same, kept = replay_canvas(ids, attn, 3, decoded[:, :2], steps[:, :2])  # a record of the response only
    assert torch.equal(same, ids) and torch.equal(kept, attn)
    with pytest.raises(ValueError, match="fewer than"):
        replay_canvas(ids, attn, 3, decoded[:, :1], steps[:, :1])


def test_ar_rows():
    P, L = 3, 5
    ids = torch.arange(1, P + L + 1)[None].repeat(2, 1)
    valid = torch.tensor([[True, True, True, False, False], [True, True, False, False, False]])
    cs = ar_rows(ids, P, valid, MASK)
    assert len(cs) == 3  # positions 3, 4 are valid nowhere: no row
    for t, r in enumerate(cs.rows):
        want = ids.clone()
        want[:, P + t:] = MASK
        assert torch.equal(r.noisy_ids, want)
        assert r.scored.sum(-1).tolist() == [1, int(valid[1, t])]
        assert r.scored[0, P + t]
    assert torch.equal(cs.scored[:, P:], valid)


def test_block_local_steps():
    steps = torch.tensor([[1, 2, 2, 3, 4, 4, 5, 0], [2, 1, 3, 3, 5, 4, 0, 0]])
    blocks = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2]] * 2)
    assert block_local(steps, blocks).tolist() == [[1, 2, 2, 1, 2, 2, 1, 0], [2, 1, 3, 1, 3, 2, 0, 0]]


def test_block_local_matches_the_rollout_record():
    model = tiny("sdar")
    sp = sampler_for(model, gen_length=8, steps=8)
    batch, out = rollout_batch(model, sp, n=3, prompt_len=8, record="steps")  # prompts of 7 and 8 tokens
    from dare_core.diffusion.mc_laws import response_blocks

    steps = batch.records["step_map"].long()
    W = steps.shape[1]  # the record keeps the terminal block whole, past gen_length
    assert W == 8 + model.block_size - 1 and (steps[:, 8:] > 0).any()
    _, attn = replay_canvas(batch.input_ids, batch.attention_mask, batch.prompt_len, batch.records["decoded"], steps)
    blocks = response_blocks(attn, batch.prompt_len, model.block_size, "global")
    local = block_local(steps, blocks)
    traj = out.trajectory
    idx = traj.response_offset[:, None] + torch.arange(W)
    want = traj.block_local_steps().gather(1, idx.clamp(max=traj.step_map.shape[1] - 1)).masked_fill(idx >= traj.step_map.shape[1], 0)
    assert torch.equal(local, want.long())
