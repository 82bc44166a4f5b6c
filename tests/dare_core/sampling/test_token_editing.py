"""Token editing (LLaDA2.1's mask-to-token + token-to-token decoding) in DARE's one decoding loop,
against the reference logic of LLaDA2.1's generation code written out here for one prompt without a
cache: per block, while masks remain, commit every masked position above `threshold` (at least the
best one) and, in the same step, replace each committed non-prompt position whose proposal differs
and is above `edit_threshold`; once the block is full, up to `post_edit_steps` more steps while they
edit. Draws go through DARE's own sampler (the reference's multinomial is another draw of the same
distribution), so greedy and sampled decoding compare token for token. Block families (SDAR,
LLaDA2) with and without the block KV cache, a prompt tail inside the first block, float64 models;
a row decodes the same in any batch; a masked family edits too."""
import pytest
import torch

from dare_core.diffusion.seeding import sample_generators
from dare_core.sampling.decode import generate
from dare_core.sampling.params import SamplingParams
from dare_core.sampling.unmasking import score_block
from tiny_models import EOS, MASK, tiny

PROMPTS = [[5, 9, 14, 3, 7, 22, 31], [40, 2, 11], [17, 8, 8, 29, 30, 1, 6, 12, 19, 44, 45]]


def reference(model, prompt: list[int], params: SamplingParams, gen) -> tuple[list[int], int]:
    """(response up to and including its first EOS, forwards) as LLaDA2.1's generate decodes one
    prompt: blocks on multiples of the block size from position 0, each recomputed with its prefix."""
    bs, p = model.block_size, len(prompt)
    n_blocks = -(-(p + params.gen_length) // bs)
    x = torch.tensor([prompt + [MASK] * (n_blocks * bs - p)])
    forwards = 0
    for b in range(p // bs, n_blocks):
        lo, hi = b * bs, (b + 1) * bs
        post = 0
        while True:
            cur = x[0, lo:hi].clone()
            is_mask = cur == MASK
            if not is_mask.any():
                post += 1
            if post > params.post_edit_steps:
                break
            logits = model(x[:, :hi])[:, lo:hi].float()
            forwards += 1
            logits[..., MASK] = float("-inf")  # (as DARE's sampler: MASK is never a proposal)
            s = score_block(logits, params, [gen] if params.stochastic else None)
            x0, conf = s.proposal[0], s.confidence[0]
            m2t = torch.zeros_like(is_mask)
            if is_mask.any():
                masked_conf = conf.masked_fill(~is_mask, float("-inf"))
                m2t = (masked_conf >= params.threshold) & is_mask
                if not m2t.any():
                    m2t[masked_conf.argmax()] = True
            not_prompt = torch.arange(lo, hi) >= p
            t2t = ~is_mask & not_prompt & (conf > params.edit_threshold) & (x0 != cur)
            x[0, lo:hi] = torch.where(m2t | t2t, x0, cur)
            if not is_mask.any() and not t2t.any():
                break
        response = x[0, p:min(hi, p + params.gen_length)].tolist()  # (the terminal block runs past gen_length)
        if EOS in response:
            return response[:response.index(EOS) + 1], forwards
    return x[0, p:p + params.gen_length].tolist(), forwards


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def _params(model, edit: float, temperature: float, cache: str, post: int = 16) -> SamplingParams:
    bs = model.block_size
    return SamplingParams(gen_length=2 * bs, steps=2 * bs, block_length=bs, unmasking="threshold", threshold=0.5,
                          temperature=temperature, remasking="maskgit_plus" if temperature else "low_confidence",
                          edit_threshold=edit, post_edit_steps=post, cache=cache)


@pytest.fixture(scope="module", params=["sdar", "llada2_moe"])
def model(request):
    return tiny(request.param).double()


@pytest.mark.parametrize("edit", [0.0, 0.3])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("cache", ["block_kv", "none"])
def test_one_prompt_decodes_as_the_reference_logic(model, edit, temperature, cache):
    params = _params(model, edit, temperature, cache)
    edited = 0
    for i, prompt in enumerate(PROMPTS):
        uid = [f"p{i}"]
        expected, forwards = reference(model, prompt, params, sample_generators((0, "edit"), uid)[0])
        out = generate(model, [prompt], params, sample_generators((0, "edit"), uid))
        assert _until_eos(out.response[0].tolist()) == expected, (i, cache)
        assert int(out.steps[0]) == forwards, i
        no_edit = generate(model, [prompt], _params(model, None, temperature, cache), sample_generators((0, "edit"), uid))
        edited += _until_eos(no_edit.response[0].tolist()) != expected
    if edit == 0.0:
        assert edited > 0  # (the edits changed some response: the comparison saw them)


def test_a_row_decodes_the_same_in_any_batch(model):
    params = _params(model, 0.0, 0.9, "block_kv")
    uids = [f"p{i}" for i in range(len(PROMPTS))]
    batch = generate(model, PROMPTS, params, sample_generators((1, "edit"), uids))
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], params, sample_generators((1, "edit"), [uids[i]]))
        assert _until_eos(batch.response[i].tolist()) == _until_eos(alone.response[0].tolist()), i
        assert int(batch.steps[i]) == int(alone.steps[0]), i


def test_no_post_steps_and_an_unreachable_threshold():
    """post_edit_steps 0 closes a block as soon as it is full (edits made while filling stay); an
    edit threshold of 1 never edits, at the cost of one forward a block that finds nothing to edit."""
    model = tiny("sdar").double()
    plain = generate(model, PROMPTS, _params(model, None, 0.0, "block_kv"))
    never = generate(model, PROMPTS, _params(model, 1.0, 0.0, "block_kv"))
    assert never.response.tolist() == plain.response.tolist()
    blocks = [len(range(0, len(_until_eos(r)), model.block_size)) for r in plain.response.tolist()]
    assert (never.steps - plain.steps).tolist() == pytest.approx(blocks, abs=1)
    closed = generate(model, PROMPTS, _params(model, 0.0, 0.0, "block_kv", post=0))
    for i, prompt in enumerate(PROMPTS):
        expected, _ = reference(model, prompt, _params(model, 0.0, 0.0, "none", post=0), None)
        assert _until_eos(closed.response[i].tolist()) == expected


def test_a_masked_family_edits_inside_its_blocks():
    """LLaDA's semi-autoregressive blocks edit as well; the dual cache refreshed every step (what
    decoding without a cache gives) re-encodes the edited block and gives the uncached tokens."""
    model = tiny("llada").double()
    settings = dict(gen_length=8, steps=8, block_length=4, unmasking="threshold", threshold=0.5)
    cached = generate(model, PROMPTS, SamplingParams(**settings, edit_threshold=0.0, cache="dual", refresh_every=1))
    plain = generate(model, PROMPTS, SamplingParams(**settings, edit_threshold=0.0))
    assert cached.response.tolist() == plain.response.tolist()
    assert plain.response.tolist() != generate(model, PROMPTS, SamplingParams(**settings)).response.tolist()  # edits happened
    from dare_core.sampling.decode import denoise_range

    with pytest.raises(ValueError, match="cannot resume"):
        denoise_range(model, PROMPTS, SamplingParams(**settings, edit_threshold=0.0), None, (0, 4))


def test_speed_and_quality_modes_are_llada21s_settings():
    """`editing: speed | quality` (a sampler layer, `dare generate/eval --editing`) stands for
    LLaDA2.1's published settings; a key beside it, or in a later layer, wins."""
    from dare_core.cli import _sampler_overrides, build_parser
    from dare_core.eval.lm import sampler_settings

    base = {"gen_length": 32, "steps": 32, "block_length": 32, "threshold": 0.95}
    speed = sampler_settings(base, {"editing": "speed"})
    assert (speed.unmasking, speed.temperature, speed.threshold, speed.edit_threshold, speed.post_edit_steps) == \
        ("threshold", 0.0, 0.5, 0.0, 16)
    quality = sampler_settings(base, {"editing": "quality", "post_edit_steps": 4})
    assert (quality.threshold, quality.edit_threshold, quality.post_edit_steps) == (0.7, 0.5, 4)
    assert sampler_settings(base, {"editing": "speed"}, {"threshold": 0.6}).threshold == 0.6
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--editing", "quality", "--threshold", "0.8"])
    assert sampler_settings(base, _sampler_overrides(args)).threshold == 0.8
    with pytest.raises(ValueError, match="unknown editing mode 'fast'"):
        sampler_settings(base, {"editing": "fast"})
    with pytest.raises(ValueError, match="edit_threshold must be >= 0"):
        SamplingParams(edit_threshold=-0.1)
    # params.yaml holds settings, not modes: the error names the mode's settings to write instead
    from dare_core.config import load_config
    from dare_core.errors import ConfigError
    from pipeline_helpers import REPO

    with pytest.raises(ConfigError, match=r"unknown config key 'rl.sampler.editing': .*threshold: 0.7, edit_threshold: 0.5"):
        load_config(REPO / "params.yaml", ["rl.sampler.editing=quality"])


def test_rl_with_edited_rollouts():
    """d1 scores the final response of an edited rollout, CJ-GRPO and MDPO replay its writes
    (tests/dare_core/algorithms); d-TreeRPO, whose tree resumes decoding, is refused up front with
    its reason, as is CJ-GRPO's step_merge (a block as one transition); lmdeploy, which cannot edit,
    refuses the setting rather than decode without it."""
    from algo_helpers import make_algo
    from dare_core.config import RLConfig, SamplerConfig
    from dare_core.sampling.engines.lmdeploy.settings import map_params

    sampler = SamplerConfig(gen_length=8, steps=8, block_length=4, unmasking="threshold", threshold=0.5, edit_threshold=0.0)
    for name, family in (("d1", "sdar"), ("cj_grpo", "sdar"), ("cj_grpo", "llada"), ("mdpo", "llada")):
        make_algo(name, tiny(family), RLConfig(sampler=sampler))
    with pytest.raises(ValueError, match="token editing.*tree resumes decoding"):
        make_algo("d_tree_rpo", tiny("llada"), RLConfig(sampler=sampler, group_size=4))
    with pytest.raises(ValueError, match="step_merge"):
        make_algo("cj_grpo", tiny("llada"), RLConfig(sampler=sampler), step_merge=True)
    with pytest.raises(ValueError, match="cannot honour token editing"):
        map_params(SamplingParams(gen_length=8, steps=8, block_length=4, cache="block_kv", edit_threshold=0.5), 4, EOS)


def test_rollouts_count_their_edits():
    """`GenerationOutput.edits` counts the tokens each row's steps replaced, as many as its record
    lists; the RL rollout logs their mean (`rollout_edits`), with or without a record (d1 asks for
    none); without editing there is no count."""
    import dataclasses

    from algo_helpers import make_algo
    from dare_core.algorithms.rollout import RolloutSpec
    from dare_core.config import RLConfig, SamplerConfig
    from dare_core.rewards.registry import REWARDS, RewardResult
    from dare_core.sampling.engines import build_engine

    model = tiny("sdar")
    params = _params(model, 0.0, 0.9, "block_kv")
    out = generate(model, PROMPTS, params, sample_generators((2, "edit"), ["a", "b", "c"]), record="steps")
    assert out.edits is not None and out.edits.sum() > 0
    assert torch.equal(out.edits, (out.trajectory.edit_steps > 0).flatten(1).sum(-1))
    assert generate(model, PROMPTS, _params(model, None, 0.9, "block_kv"), sample_generators((2, "edit"), ["a", "b", "c"])).edits is None

    class Tokenizer:
        eos_token_id = EOS

        def encode(self, text):
            return [1 + ord(c) % 30 for c in text]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    REWARDS.setdefault("test_token_editing_len", lambda text, truth, extra=None: RewardResult(float(len(text) % 2), 0.0, None))
    sampler = SamplerConfig(**dataclasses.asdict(params), batch_size=3)
    rows = [{"uid": "a", "prompt_text": "12+3=", "ground_truth": "15"}, {"uid": "b", "prompt_text": "7+2=", "ground_truth": "9"}]
    for name in ("d1", "cj_grpo"):
        rl = RLConfig(sampler=sampler, group_size=2, reward="test_token_editing_len")
        algo = make_algo(name, model, rl)
        batch, metrics = algo.rollout(build_engine("native", model), Tokenizer(), rows, RolloutSpec.of(rl, 0, 0))
        assert metrics["rollout_edits"] > 0, name
        if name == "cj_grpo":
            assert metrics["rollout_edits"] == pytest.approx(float((batch.records["edit_steps"] > 0).flatten(1).sum(-1).float().mean()))
