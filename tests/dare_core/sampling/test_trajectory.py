"""Rollout records (docs/sampling.md#rollout-records): replay, early stop at EOS, the terminal block's latent tokens."""
import pytest
import torch

from dare_core.sampling.decode import generate
from dare_core.sampling.params import SamplingParams
from tiny_models import tiny

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("family,cache", [("llada", "none"), ("Dream", "none"), ("sdar", "block_kv")])
def test_recorded_trajectory_replays_to_the_final_sequence(family, cache):
    """Feeding each recorded state back to the model reproduces the recorded proposals, and the
    proposals committed at each step build the final sequence."""
    model = tiny(family).double()
    bl = model.block_size or 4
    params = SamplingParams(gen_length=4 * bl, steps=2 * bl, block_length=bl, cache=cache, stop_at_eos=False)
    out = generate(model, PROMPTS, params, record="full")
    traj = out.trajectory
    origin_cols = out.trajectory.tokens.shape[1]
    for b, prompt in enumerate(PROMPTS):
        fixed_prompt = prompt[:len(prompt) - int(traj.response_offset[b])]  # the part before the window
        rebuilt = None
        for k, state in enumerate(traj.states(b)):
            ids = torch.tensor([fixed_prompt + state.tolist()])
            logits = model(ids)[0, len(fixed_prompt):]
            logits[:, model.mask_token_id] = float("-inf")
            predicted = traj.x0_hat[b, k] >= 0
            assert torch.equal(logits.argmax(-1)[predicted], traj.x0_hat[b, k][predicted].long())
            committed = traj.step_map[b] == k + 1
            rebuilt = state.clone() if rebuilt is None else rebuilt
            rebuilt[committed] = traj.x0_hat[b, k][committed].long()
        assert torch.equal(rebuilt, traj.tokens[b]) and rebuilt.shape[0] == origin_cols
        off = int(traj.response_offset[b])
        assert torch.equal(rebuilt[off:off + params.gen_length], out.response[b])


def test_response_step_map_and_block_local_steps():
    model = tiny("sdar").double()
    params = SamplingParams(gen_length=8, steps=4, block_length=4, cache="block_kv", stop_at_eos=False)
    out = generate(model, PROMPTS, params, record="steps")
    traj = out.trajectory
    local = traj.block_local_steps()
    for b in range(len(PROMPTS)):
        off = int(traj.response_offset[b])
        assert (traj.step_map[b, :off] == 0).all()  # the prompt tail is not decoded
        assert torch.equal(out.step_map[b], traj.step_map[b, off:off + 8])
        for lo in range(0, local.shape[1], 4):
            used = local[b, lo:lo + 4]
            if (used > 0).any():
                assert set(used[used > 0].tolist()) == set(range(1, int(used.max()) + 1))
    valid = (traj.step_map > 0)
    traj.validate(valid)
    bad = valid.clone()
    bad[0, -1] = ~bad[0, -1]
    with pytest.raises(ValueError, match="valid position"):
        traj.validate(bad)


@pytest.mark.parametrize("family,cache", [("sdar", "block_kv"), ("llada", "dual")])
def test_stop_mid_block_cuts_the_response_and_keeps_the_terminal_block(family, cache):
    model = tiny(family).double()
    bl = 4
    params = SamplingParams(gen_length=16, steps=16, block_length=bl, cache=cache, stop_at_eos=False)
    free = generate(model, PROMPTS, params, record="steps")
    row = free.response[0].tolist()
    pos = next(i for i in range(1, 12) if row[i] not in row[:i])  # a token whose first occurrence is at i
    stop_id = row[pos]
    stopped = generate(model, PROMPTS, SamplingParams(**{**params.__dict__, "stop_at_eos": True, "stop_token_ids": [stop_id]}), record="steps")
    resp = stopped.response[0].tolist()
    assert resp[:pos + 1] == row[:pos + 1]
    assert all(t == model.eos_token_id for t in resp[pos + 1:])
    assert int(stopped.lengths[0]) == pos + 1 and stopped.stop_reason[0] == "eos"
    traj = stopped.trajectory
    off = int(traj.response_offset[0])
    # the terminal block (the one holding the stop) was decoded whole and is kept in the record
    end = (off + pos) // bl * bl + bl
    assert torch.equal(traj.tokens[0, off:end], free.trajectory.tokens[0, off:end])
    assert (traj.step_map[0, off:end] > 0).all()
    # nothing after it was decoded: the sequence left the batch
    assert (traj.step_map[0, end:] == 0).all() and (traj.tokens[0, end:] == model.mask_token_id).all()
    assert int(stopped.steps[0]) < int(free.steps[0])


def test_no_stop_reports_the_full_length():
    model = tiny("llada").double()
    out = generate(model, PROMPTS, SamplingParams(gen_length=8, steps=8, block_length=4, stop_at_eos=False))
    has_eos = (out.response == model.eos_token_id).any(-1)
    for b in range(len(PROMPTS)):
        if not has_eos[b]:
            assert out.stop_reason[b] == "length" and int(out.lengths[b]) == 8
    assert out.sampler["engine"] == "native" and out.sampler["gen_length"] == 8


@pytest.mark.parametrize("family,cache", [("llada", "none"), ("sdar", "block_kv"), ("llada2_moe", "none")])
def test_an_edited_trajectory_replays_write_by_write(family, cache):
    """Token editing: each recorded state fed back reproduces the step's proposals; the state after
    a step is the one before it with the step's writes (commits and edits) applied, up to the final
    tokens; an edit replaced exactly the token the state held."""
    model = tiny(family).double()
    bl = model.block_size or 4
    params = SamplingParams(gen_length=2 * bl, steps=2 * bl, block_length=bl, cache=cache, stop_at_eos=False,
                            unmasking="threshold", threshold=0.5, edit_threshold=0.0, post_edit_steps=3)
    out = generate(model, PROMPTS, params, record="full")
    traj = out.trajectory
    assert traj.edit_steps is not None and (traj.edit_steps > 0).sum() >= 3, "the rollout edited too little to test"
    edits_seen = 0
    for b, prompt in enumerate(PROMPTS):
        fixed_prompt = prompt[:len(prompt) - int(traj.response_offset[b])]
        states = [*traj.states(b), traj.tokens[b]]
        assert len(states) == int(traj.num_steps[b]) + 1
        for k, state in enumerate(states[:-1], start=1):
            logits = model(torch.tensor([fixed_prompt + state.tolist()]))[0, len(fixed_prompt):]
            logits[:, model.mask_token_id] = float("-inf")
            predicted = traj.x0_hat[b, k - 1] >= 0
            assert torch.equal(logits.argmax(-1)[predicted], traj.x0_hat[b, k - 1][predicted].long())
            edited = traj.edit_steps[b] == k  # [W, E]
            pos, slot = edited.nonzero(as_tuple=True)
            assert torch.equal(state[pos], traj.edit_from[b, pos, slot].long()) and (state[pos] != model.mask_token_id).all()
            edits_seen += pos.numel()
            written = (traj.step_map[b] == k) | edited.any(-1)
            after = torch.where(written, traj.x0_hat[b, k - 1].long(), state)
            assert torch.equal(after, states[k]), (b, k)
    assert edits_seen == int((traj.edit_steps > 0).sum())


def test_without_edits_the_record_has_none():
    model = tiny("sdar")
    out = generate(model, PROMPTS, SamplingParams(gen_length=8, steps=8, block_length=4, cache="block_kv"), record="steps")
    assert out.trajectory.edit_steps is None
    steps, replaced = out.trajectory.response_edits(8)
    assert steps.shape == replaced.shape == (len(PROMPTS), 8, 0)
