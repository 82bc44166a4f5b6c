"""JustGRPO (docs/diffusion.md#exact-ar, docs/algorithms.md#just-grpo): the left-to-right rollout's per-step log-probs are the
learner's s_t; the token PPO loss by hand; samplers it cannot be exact for are refused."""
import math

import pytest
import torch

from algo_helpers import make_algo, run_update
from dare_core.algorithms.just_grpo import left_to_right
from dare_core.algorithms.rollout import RolloutSpec
from dare_core.config import RLConfig, SamplerConfig
from dare_core.rewards.base import RewardResult
from dare_core.rewards.registry import REWARDS
from dare_core.sampling.engines import build_engine
from rl_reference import plain_logp, ppo
from rollout_helpers import rollout_batch
from tiny_models import tiny

MASK = 63


def _sampler(**kw):
    return SamplerConfig(**{"gen_length": 8, "steps": 8, "block_length": 1, "temperature": 0.7, **kw})


@pytest.mark.parametrize("family", ["llada", "Dream"])
def test_rollout_logprobs_are_the_learner_scores(family):
    """maskgit_plus logs p(x) under the tempered distribution the token was drawn from."""
    model = tiny(family)
    sp = _sampler(remasking="maskgit_plus")
    batch, out = rollout_batch(model, sp, n=4, record="full")
    algo = make_algo("just_grpo", model, RLConfig(sampler=sp))
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s = algo.score(model, batch, cs)[:, batch.prompt_len:]
    tr = out.trajectory
    assert torch.equal(out.step_map[batch.response_mask], torch.arange(1, 9).expand(4, 8)[batch.response_mask].int())
    for b in range(4):
        for t in range(8):
            if batch.response_mask[b, t]:  # step t + 1 committed position t, one token per step
                logged = math.log(tr.confidence[b, t, tr.response_offset[b] + t])
                assert s[b, t].item() == pytest.approx(logged, abs=1e-5)
            else:
                assert s[b, t] == 0
    # and the sequence score is the exact log-likelihood of the sampled response
    assert torch.isfinite(s.sum(-1)).all()


def test_loss_by_hand():
    model = tiny("llada")
    sp = _sampler()
    batch, _ = rollout_batch(model, sp, n=4, record="none")
    rl = RLConfig(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0, rows_per_forward=3, sampler=sp)
    algo = make_algo("just_grpo", model, rl)
    cs = algo.corrupt(batch, (0, 0, 0))
    with torch.no_grad():
        s0 = algo.score(model, batch, cs)
    old = s0 + 0.4 * torch.randn(s0.shape, generator=torch.Generator().manual_seed(0)) * cs.scored
    out = run_update(algo, model, batch, cs, old, None, backward=False)
    P = batch.prompt_len
    terms = []
    for t in range(8):
        z = batch.input_ids.clone()
        z[:, P + t:] = MASK
        lp = plain_logp(model, z, batch.input_ids, batch.attention_mask, 0.7, (MASK,))
        for b in range(4):
            if batch.response_mask[b, t]:
                terms.append(ppo(math.exp(lp[b, P + t].item() - old[b, P + t].item()), batch.advantages[b].item()))
    assert float(out.loss) == pytest.approx(sum(terms) / len(terms), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("bad", [{"cache": "prefix"}, {"cache": "dual"}, {"temperature": 0.0}, {"top_k": 5}, {"top_p": 0.9}])
def test_refuses_samplers_it_cannot_be_exact_for(bad):
    with pytest.raises(ValueError, match="just_grpo"):
        make_algo("just_grpo", tiny("llada"), RLConfig(sampler=_sampler(**bad)))


def test_masked_families_only():
    with pytest.raises(ValueError, match="masked"):
        make_algo("just_grpo", tiny("sdar"), RLConfig(sampler=_sampler()))


class _Tokenizer:
    eos_token_id = 62

    def encode(self, text):
        return [1 + (ord(c) % 30) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _any_reward(text, ground_truth, extra=None):
    return RewardResult(float(len(text) % 2), 0.0, None)


REWARDS.setdefault("test_just_grpo_any", _any_reward)


def test_rollouts_are_left_to_right_whatever_the_sampler_says():
    """The configured sampler decodes 8 positions in one block in 4 steps; the algorithm's rollout
    still commits one position per step, in order (its definition), and validation keeps rl.sampler."""
    model = tiny("llada")
    sp = _sampler(block_length=8, steps=4)
    rl = RLConfig(sampler=sp, group_size=2, reward="test_just_grpo_any")
    algo = make_algo("just_grpo", model, rl)
    algo.requires = frozenset({"step_map"})  # ask the rollout to record when each position was decoded
    rows = [{"uid": "a", "prompt_text": "12+3=", "ground_truth": "15"}, {"uid": "b", "prompt_text": "7+2=", "ground_truth": "9"}]
    batch, metrics = algo.rollout(build_engine("native", model), _Tokenizer(), rows, RolloutSpec.of(rl, 0, 0))
    assert len(batch) == 4 and metrics["rollout_steps"] == 8
    order = torch.arange(1, 9).expand(4, 8)
    assert torch.equal(batch.records["step_map"][batch.response_mask].long(), order[batch.response_mask])
    assert left_to_right(sp).block_length == 1 and left_to_right(sp).steps == 8 and rl.sampler.block_length == 8
