"""CJ-GRPO (docs/diffusion.md#trajectory-replay, docs/algorithms.md#cj-grpo): replayed log-probs of a cache-free rollout equal the sampler's
logged per-step ones; the MDLM loss (1/K) sum_k token-mean_k and the BDLM Eq. 11 loss by hand; only
the valid region is scored (masked diffusion); step_merge."""
import math

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.algorithms.cj_grpo import CJGRPO
from dare_core.batch import Batch
from dare_core.config import RLConfig
from rl_reference import plain_logp, ppo
from rollout_helpers import rollout_batch, sampler_for
from tiny_models import tiny

EOS, MASK = 62, 63


def _logged(out, L):
    """[B, L] log of the confidence the sampler logged for each response position at the step
    that committed it (NaN where never committed)."""
    tr = out.trajectory
    steps = tr.response_step_map(L).long()
    cols = tr.response_offset[:, None] + torch.arange(L)
    got = torch.full(steps.shape, float("nan"))
    for b in range(steps.shape[0]):
        for i in range(L):
            if steps[b, i] > 0:
                got[b, i] = math.log(tr.confidence[b, steps[b, i] - 1, cols[b, i]])
    return got


@pytest.mark.parametrize("family,remasking,temperature,score_temperature", [
    ("llada", "low_confidence", 1.0, None),  # LLaDA's confidence is the untempered probability
    ("llada", "low_confidence", 0.7, 1.0),  # ... so it is the replay at tau = 1 (the reference's choice)
    ("llada", "maskgit_plus", 0.7, None),  # the tempered probability: the replay at the rollout temperature
    ("Dream", "maskgit_plus", 0.7, None),
    ("sdar", "maskgit_plus", 0.7, None),
    ("sdar", "low_confidence", 1.0, None),
])
def test_replay_equals_logged_rollout_logprobs(family, remasking, temperature, score_temperature):
    model = tiny(family)
    steps = 4 if model.block_size is None else 8
    sp = sampler_for(model, remasking=remasking, temperature=temperature, steps=steps)
    # block diffusion: prompts of whole blocks, so the last response block ends with the canvas
    batch, out = rollout_batch(model, sp, n=4, prompt_len=8 if model.block_size else 5, record="full",
                               same_length=model.block_size is not None)
    algo = make_algo("cj_grpo", model, RLConfig(sampler=sp), score_temperature=score_temperature)
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s = algo.score(model, batch, cs)[:, batch.prompt_len:]
    logged = _logged(out, s.shape[1])
    scored = cs.scored[:, batch.prompt_len:]
    assert scored.any() and not torch.isnan(logged[scored]).any()
    torch.testing.assert_close(s[scored], logged[scored], atol=1e-5, rtol=0)


def test_replay_of_a_block_straddling_the_canvas_end():
    """A prompt tail of 3 and gen_length 8: the terminal block holds 3 response positions and one
    column past gen_length, which the sampler decoded and the block attended to. The record keeps
    it, so the replay equals the rollout there too, and the response stays cut at gen_length."""
    model = tiny("sdar")
    sp = sampler_for(model, remasking="low_confidence", temperature=1.0, stop_at_eos=False)
    batch, out = rollout_batch(model, sp, n=2, prompt_len=7, record="full", same_length=True)  # a prompt tail of 3
    assert batch.input_ids.shape[1] == batch.prompt_len + 8 and batch.records["step_map"].shape[1] == 8 + 3
    algo = make_algo("cj_grpo", model, RLConfig(sampler=sp))
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s = algo.score(model, batch, cs)[:, batch.prompt_len:]
    scored = cs.scored[:, batch.prompt_len:]
    assert scored[:, 8].all() and not scored[:, 9:].any()  # the column past gen_length is a latent action
    torch.testing.assert_close(s[scored], _logged(out, s.shape[1])[scored], atol=1e-5, rtol=0)


def test_replay_states_of_the_terminal_block_are_the_sampler_states():
    """Position by position, every replay state equals the sampler's state before that step over
    the whole window (the terminal block's column past gen_length included), and every token the
    sampler decoded is scored at exactly its step."""
    model = tiny("sdar")
    sp = sampler_for(model, remasking="low_confidence", temperature=1.0, stop_at_eos=False)
    batch, out = rollout_batch(model, sp, n=2, prompt_len=7, record="steps", same_length=True)
    algo = make_algo("cj_grpo", model, RLConfig(sampler=sp))
    cs = algo.corrupt(batch, (0, 0, 0))
    tr, P, bs = out.trajectory, batch.prompt_len, model.block_size
    W = batch.records["step_map"].shape[1]
    for row in range(len(batch)):
        off = int(tr.response_offset[row])
        window = tr.tokens.shape[1] - off  # the response and the rest of its terminal block
        assert window == 8 + 1 and cs.scored.shape[1] >= P + window, "the replay lacks the terminal block's last column"
        local = tr.block_local_steps()[row]
        blk_of = torch.arange(tr.tokens.shape[1]) // bs
        for g, state in enumerate(tr.states(row), start=1):
            # the block decoded at global step g and its block-local step there
            at = (tr.step_map[row] == g).nonzero().squeeze(-1)
            blk, k = int(blk_of[at[0]]), int(local[at[0]])
            noisy = cs.rows[k - 1].noisy_ids[row, P:P + window]
            inside = blk_of[off:] == blk
            assert torch.equal(noisy[inside], state[off:][inside]), (row, g)
            # the clean context of that step: earlier blocks as the sampler finally had them
            earlier = blk_of[off:] < blk
            assert torch.equal(cs.rows[k - 1].targets[row, P:P + window][earlier], tr.tokens[row, off:][earlier])
            scored_here = cs.rows[k - 1].scored[row, P:P + window] & inside
            assert torch.equal(scored_here, tr.step_map[row, off:] == g)
        assert not cs.scored[row, P + window:].any() and (cs.rows[0].noisy_ids[row, P + window:] == MASK).all()
    assert cs.scored.shape[1] == P + W


def test_rl_rollout_records_keep_the_terminal_block_across_chunks():
    """The RL loop's records: chunks whose prompts leave different tails (so terminal blocks that
    run 0 to 3 columns past gen_length) concatenate at one width, each row holding what its
    sampler decoded there."""
    from dare_core.algorithms.rollout import _records
    from dare_core.sampling.decode import generate

    model = tiny("sdar")
    sp = sampler_for(model, stop_at_eos=False)
    chunks = [[[5, 6, 7, 8]], [[1, 2, 3, 4, 5, 6, 7], [9, 10, 11, 12, 13]]]  # tails 0; 3 and 1
    outs = [generate(model, p, sp, [torch.Generator().manual_seed(i) for i in range(len(p))], record="steps") for p in chunks]
    rec = _records(outs, CJGRPO.requires, model.block_size)
    assert rec["step_map"].shape == rec["decoded"].shape == (3, 8 + 3)
    assert (rec["step_map"] > 0).sum(-1).tolist() == [8, 9, 11]
    for o, rows in zip(outs, ([0], [1, 2])):
        tr = o.trajectory
        for j, r in enumerate(rows):
            off = int(tr.response_offset[j])
            n = tr.tokens.shape[1] - off
            assert torch.equal(rec["decoded"][r, :n], tr.tokens[j, off:]) and torch.equal(rec["step_map"][r, :n], tr.step_map[j, off:])
            v = int(o.lengths[j])  # the response (cut at gen_length, EOS after a stop) is the record's start
            assert torch.equal(rec["decoded"][r, :v], o.response[j, :v])


def _rl(sp, **kw):
    return RLConfig(**{"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip": 3.0, "rows_per_forward": 2, "sampler": sp, **kw})


@pytest.mark.parametrize("family", ["llada", "Dream"])
def test_mdlm_loss_by_hand(family):
    """L = (1/K) sum_k L_k, L_k the token-mean over the step's committed valid tokens of the batch,
    each scored on the state before step k at the rollout temperature."""
    model = tiny(family)
    sp = sampler_for(model, steps=4, temperature=0.8)
    batch, _ = rollout_batch(model, sp, n=4, record="steps")
    algo = make_algo("cj_grpo", model, _rl(sp))
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s0 = algo.score(model, batch, cs)
    old = s0 + 0.3 * torch.randn(s0.shape, generator=torch.Generator().manual_seed(1)) * cs.scored
    out = run_update(algo, model, batch, cs, old, None, backward=False)
    P = batch.prompt_len
    steps, decoded = batch.records["step_map"].long(), batch.records["decoded"]
    targets = torch.cat([batch.input_ids[:, :P], decoded], 1)
    per_step = []
    for k in range(1, int(steps.max()) + 1):
        state = torch.where((steps > 0) & (steps < k), decoded, torch.full_like(decoded, MASK))
        lp = plain_logp(model, torch.cat([batch.input_ids[:, :P], state], 1), targets, batch.attention_mask, 0.8, (MASK,))
        terms = []
        for b in range(len(batch)):
            for i in range(8):
                if steps[b, i] == k and batch.response_mask[b, i]:
                    r = math.exp(lp[b, P + i].item() - old[b, P + i].item())
                    terms.append(ppo(r, batch.advantages[b].item()))
        if terms:
            per_step.append(sum(terms) / len(terms))
    assert float(out.loss) == pytest.approx(sum(per_step) / len(per_step), rel=1e-4, abs=1e-6)


def test_bdlm_eq11_loss_by_hand():
    """token-mean inside each (sample, block, local step) transition, mean over the sample's
    transitions, mean over samples; every decoded token scored (terminal-block latents too)."""
    model = tiny("sdar")
    sp = sampler_for(model, temperature=0.9)
    batch, _ = rollout_batch(model, sp, n=4, prompt_len=6, record="steps")
    algo = make_algo("cj_grpo", model, _rl(sp))
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s0 = algo.score(model, batch, cs)
    old = s0 + 0.3 * torch.randn(s0.shape, generator=torch.Generator().manual_seed(2)) * cs.scored
    out = run_update(algo, model, batch, cs, old, None, backward=False)
    P = batch.prompt_len
    steps, decoded = batch.records["step_map"].long(), batch.records["decoded"]
    W = steps.shape[1]
    assert (steps[:, 8:] > 0).any()  # terminal blocks that run past gen_length: their latents count too
    targets = torch.cat([batch.input_ids[:, :P], decoded], 1)
    attn = torch.cat([batch.attention_mask, (steps[:, 8:] > 0).long()], 1)  # what the sampler decoded
    pos = attn.cumsum(-1)[:, P:] - 1
    blocks = pos // model.block_size
    local = torch.zeros_like(steps)
    for b in range(len(batch)):
        for blk in blocks[b].unique():
            inside = (blocks[b] == blk) & (steps[b] > 0)
            if inside.any():
                local[b, inside] = steps[b, inside] - steps[b, inside].min() + 1
    assert torch.equal(cs.scored[:, P:], steps > 0)
    total = 0.0
    lps = {}
    for k in range(1, int(local.max()) + 1):
        state = torch.where((local > 0) & (local < k), decoded, torch.full_like(decoded, MASK))
        lps[k] = plain_logp(model, torch.cat([batch.input_ids[:, :P], state], 1), targets, attn, 0.9, (MASK,))
    for b in range(len(batch)):
        transitions = {}
        for i in range(W):
            if steps[b, i] > 0:
                k = int(local[b, i])
                r = math.exp(lps[k][b, P + i].item() - old[b, P + i].item())
                transitions.setdefault((int(blocks[b, i]), k), []).append(ppo(r, batch.advantages[b].item()))
        total += sum(sum(v) / len(v) for v in transitions.values()) / len(transitions)
    assert float(out.loss) == pytest.approx(total / len(batch), rel=1e-4, abs=1e-6)


def test_only_the_valid_region_is_scored_and_the_tail_is_context():
    model = tiny("llada")
    sp = sampler_for(model, steps=8)
    P = 3
    ids = torch.tensor([[1, 2, 3, 10, 11, EOS, 20, 21, EOS, EOS, EOS]])
    decoded = torch.tensor([[10, 11, EOS, 20, 21, 22, 23, 24]])
    steps = torch.tensor([[3, 1, 5, 2, 4, 6, 7, 8]])
    valid = torch.tensor([[True, True, True, False, False, False, False, False]])
    batch = Batch(ids, torch.ones_like(ids), P, valid, ["x"], torch.tensor([1.0]), {"step_map": steps, "decoded": decoded})
    algo = make_algo("cj_grpo", model, _rl(sp))
    cs = algo.corrupt(batch, (0, 0, 0))
    assert torch.equal(cs.scored[:, P:], valid)
    # the tail token committed at step 2 is context from step 3 on, as the rollout had it
    assert cs.rows[2].noisy_ids[0, P + 3] == 20 and cs.rows[1].noisy_ids[0, P + 3] == MASK
    assert not any(r.scored[0, P + 3:].any() for r in cs.rows)
    out = run_update(algo, model, batch, cs, None, None)
    assert math.isfinite(float(out.loss))
    # denominators: one slot per step (max(steps, gen_length)), counting the scored tokens
    assert algo.denominator(batch, cs).tolist() == [1, 0, 1, 0, 1, 0, 0, 0]


def test_step_merge_one_transition_per_block():
    model = tiny("llada")
    sp = sampler_for(model, steps=8)
    batch, _ = rollout_batch(model, sp, n=2, record="steps")
    algo = make_algo("cj_grpo", model, _rl(sp), step_merge=True)
    cs = algo.corrupt(batch, (0, 0, 0))
    assert len(cs) == 2  # gen_length 8 / block_length 4
    P = batch.prompt_len
    assert torch.equal(cs.rows[0].noisy_ids[:, P:], torch.full((2, 8), MASK))
    assert torch.equal(cs.rows[1].noisy_ids[:, P:P + 4], batch.records["decoded"][:, :4])
    assert (cs.rows[1].noisy_ids[:, P + 4:] == MASK).all()


def _editing(model, **kw):
    return sampler_for(model, unmasking="threshold", threshold=0.5, edit_threshold=0.0, post_edit_steps=2, **kw)


@pytest.mark.parametrize("family,remasking,temperature", [
    ("llada", "low_confidence", 1.0),
    ("sdar", "maskgit_plus", 0.7),
])
def test_an_edited_rollout_replays_every_write(family, remasking, temperature):
    """Token editing (docs/algorithms.md#edited-rollouts): every write of a position, its commit and
    each later edit, is scored once, in its own entry (slot j of position i: j * S + i), at the
    log-probability the sampler logged for it at its step; entries of writes that never happened
    are 0."""
    model = tiny(family)
    block = model.block_size is not None
    sp = _editing(model, remasking=remasking, temperature=temperature)
    batch, out = rollout_batch(model, sp, n=4, prompt_len=8 if block else 5, record="full", same_length=block)
    assert "edit_steps" in batch.records
    algo = make_algo("cj_grpo", model, RLConfig(sampler=sp))
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s = algo.score(model, batch, cs)
    tr, P, S = out.trajectory, batch.prompt_len, cs.scored.shape[1]
    n = s.shape[1] // S
    assert s.shape[1] == n * S and n == batch.records["edit_steps"].shape[-1] + 1
    expected = torch.zeros(len(batch), n, S)
    edits = 0
    for b in range(len(batch)):
        off = int(tr.response_offset[b])
        for i in range(min(S - P, tr.tokens.shape[1] - off)):
            col = off + i
            writes = [int(tr.step_map[b, col])] + [int(e) for e in tr.edit_steps[b, col] if e > 0]
            if writes[0] == 0 or (not block and not batch.response_mask[b, i]):
                continue
            edits += len(writes) - 1
            for j, g in enumerate(writes):
                expected[b, j, P + i] = math.log(tr.confidence[b, g - 1, col])
    assert edits > 0
    torch.testing.assert_close(s.view(len(batch), n, S), expected, atol=1e-5, rtol=0)


def test_mdlm_loss_by_hand_with_edits():
    """As test_mdlm_loss_by_hand, each write an action of its step: L = (1/K) sum_k L_k, L_k the
    token-mean over the writes of step k (commits and edits), each scored on the state before step
    k (earlier edits applied) against the token the step wrote, its old score in the write's entry."""
    model = tiny("llada")
    sp = _editing(model, temperature=0.8, remasking="maskgit_plus")
    batch, out = rollout_batch(model, sp, n=4, record="full")
    algo = make_algo("cj_grpo", model, _rl(sp))
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s0 = algo.score(model, batch, cs)
    old = s0 + 0.3 * torch.randn(s0.shape, generator=torch.Generator().manual_seed(1)) * (s0 != 0)
    res = run_update(algo, model, batch, cs, old, None, backward=False)
    tr, P, L = out.trajectory, batch.prompt_len, 8
    S = P + L
    per_step, edits = [], 0
    states = [list(tr.states(b)) for b in range(len(batch))]
    for k in range(1, int(tr.num_steps.max()) + 1):
        noisy, written = batch.input_ids.clone(), batch.input_ids.clone()
        for b in range(len(batch)):
            if k <= len(states[b]):
                noisy[b, P:] = states[b][k - 1]
            written[b, P:] = tr.x0_hat[b, k - 1].clamp_min(0)
        lp = plain_logp(model, noisy, written, batch.attention_mask, 0.8, (MASK,))
        terms = []
        for b in range(len(batch)):
            for i in range(L):
                writes = [int(tr.step_map[b, i])] + [int(e) for e in tr.edit_steps[b, i] if e > 0]
                if k in writes and batch.response_mask[b, i]:
                    j = writes.index(k)
                    edits += j > 0
                    r = math.exp(lp[b, P + i].item() - old[b, j * S + P + i].item())
                    terms.append(ppo(r, batch.advantages[b].item()))
        if terms:
            per_step.append(sum(terms) / len(terms))
    assert edits > 0
    assert float(res.loss) == pytest.approx(sum(per_step) / len(per_step), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_edited_rollouts_update_as_any(family):
    """Edited rollouts through the shared RL properties: a finite update with gradients, none from
    zero advantages, and the same gradient for every micro-batch split (the entries per write
    select and sum like the per-token ones)."""
    from rl_reference import grads

    model = tiny(family).double()
    sp = _editing(model, temperature=0.9, remasking="maskgit_plus")
    batch, _ = rollout_batch(model, sp, n=6, prompt_len=6, record="steps", advantages=torch.linspace(-1.2, 1.0, 6))
    assert "edit_steps" in batch.records
    algo = make_algo("cj_grpo", model, _rl(sp, kl_beta=0.05, kl_estimator="k3"))
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s = algo.score(model, batch, cs)
    noise = torch.randn(s.shape, generator=torch.Generator().manual_seed(0), dtype=s.dtype)
    old, ref = s + 0.3 * noise, s - 0.2 * noise
    denom = algo.denominator(batch, cs)
    found = []
    for size in (6, 1, 4):
        model.zero_grad()
        total = 0.0
        for mb in torch.arange(6).split(size):
            total += float(run_update(algo, model, batch.select(mb), cs.select(mb), old[mb], ref[mb], denom).loss)
        found.append((total, grads(model)))
    assert math.isfinite(found[0][0]) and found[0][1].abs().sum() > 0
    for total, g in found[1:]:
        assert total == pytest.approx(found[0][0], rel=1e-5, abs=1e-8)
        assert float((g - found[0][1]).norm() / found[0][1].norm()) < 1e-5
    model.zero_grad()
    batch.advantages = torch.zeros(6)
    run_update(algo, model, batch, cs, s, None)
    assert grads(model).abs().max() == 0
