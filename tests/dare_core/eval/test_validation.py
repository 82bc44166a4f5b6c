"""mean@k / best@k / maj@k: hand-computed on made-up groups, and `validate` on a tiny model is
reproducible, independent of the batch size and ordered best@k >= mean@k."""
import string

import pytest

from dare_core.eval.validation import answer_of, at_k_metrics, validate
from dare_core.models.tokenizer import build_char_tokenizer
from dare_core.rewards import REWARDS, RewardResult
from dare_core.sampling.engines import build_engine
from dare_core.sampling.params import SamplingParams
from rollout_helpers import RecordingEngine


def s(acc: float, pred, text: str = ""):
    """One graded sample."""
    return RewardResult(acc, acc, pred), text


def test_at_k_by_hand():
    groups = [
        # 2 of 4 right; "7" (wrong) has 2 votes against 1 for "5" (right): maj picks the wrong one
        [s(1, "5"), s(0, "7"), s(0, "7"), s(1, "5 ")],  # "5 " is another answer than "5"
        # all wrong
        [s(0, "1"), s(0, "2"), s(0, "3"), s(0, "4")],
        # 1 of 4 right; a 2-2 tie between "9" (seen first, right) and "8": the first seen wins
        [s(1, "9"), s(0, "8"), s(0, "8"), s(0, "9")],
    ]
    m = at_k_metrics(groups)
    assert m.keys() == {"mean@4", "best@4", "maj@4"}
    assert m["mean@4"] == pytest.approx((2 / 4 + 0 + 1 / 4) / 3)
    assert m["best@4"] == pytest.approx(2 / 3)
    # prompt 1: "7" wins 2-1-1 (wrong); prompt 2: a 1-1-1-1 tie goes to "1" (wrong); prompt 3: "9" (right)
    assert m["maj@4"] == pytest.approx(1 / 3)


def test_tie_goes_to_the_answer_seen_first():
    assert at_k_metrics([[s(0, "a"), s(1, "b")]])["maj@2"] == 0.0
    assert at_k_metrics([[s(1, "b"), s(0, "a")]])["maj@2"] == 1.0


def test_unparsed_samples_vote_with_their_stripped_text():
    # the reward extracted nothing: " 12 \n" and "12" agree (stripped text) and outvote the parsed "3"
    groups = [[s(0, None, " 12 \n"), s(1, "3", "the answer is 3"), s(0, None, "12")]]
    assert answer_of(*groups[0][0]) == "12" and answer_of(*groups[0][1]) == "3"
    m = at_k_metrics(groups)
    assert m == {"mean@3": pytest.approx(1 / 3), "best@3": 1.0, "maj@3": 0.0}
    # a pred, even one equal to another sample's text, is what that sample votes for
    assert at_k_metrics([[s(1, "12", "x"), s(0, None, "12"), s(0, None, "y")]])["maj@3"] == 1.0


def test_k_1_is_plain_accuracy_and_bad_groups_are_errors():
    m = at_k_metrics([[s(1, "1")], [s(0, "2")]])
    assert m == {"mean@1": 0.5, "best@1": 0.5, "maj@1": 0.5}
    with pytest.raises(ValueError, match="at least one prompt"):
        at_k_metrics([])
    with pytest.raises(ValueError, match="same number"):
        at_k_metrics([[s(1, "1")], [s(1, "1"), s(0, "2")]])


# --------------------------------------------------------------------------- validate on a tiny model

FIRST_CHAR = "test-first-char"


def first_char_reward(text: str, ground_truth: str, extra=None) -> RewardResult:
    """Right when the response starts with one of the ground truth's characters: a random model
    gets it right sometimes, so the metrics are not all 0."""
    if not text:
        return RewardResult(0.0, 0.0, None)
    acc = float(text[0] in ground_truth)
    return RewardResult(acc, acc, text[0])


@pytest.fixture
def setup(tmp_path, monkeypatch):
    from conftest import make_tiny_llada

    monkeypatch.setitem(REWARDS, FIRST_CHAR, first_char_reward)
    tok = build_char_tokenizer(tmp_path / "tok")
    model = make_tiny_llada(tok.vocab_size, tok.mask_token_id, tok.eos_token_id, seed=3)
    # a random model's first characters are spread over the ~100 of the vocabulary: 20-40 are right
    rows = [{"uid": f"v{i}", "task": FIRST_CHAR, "ground_truth": (string.ascii_letters + string.digits)[: 20 + 5 * (i % 5)],
             "prompt_text": tok.apply_chat_template([{"role": "user", "content": f"{i}+{i}="}])} for i in range(9)]
    params = SamplingParams(gen_length=4, steps=4, block_length=4, temperature=1.0)
    return model, tok, rows, params


def test_validate_is_reproducible_and_batch_size_free(setup):
    model, tok, rows, params = setup
    model.train()
    a = validate(build_engine("native", model), tok, rows, params, k=4, seed=7, step=3, batch_size=7)
    assert model.training  # left in the mode it came in
    assert a == validate(build_engine("native", model), tok, rows, params, k=4, seed=7, step=3, batch_size=7)
    one = validate(build_engine("native", model), tok, rows, params, k=4, seed=7, step=3, batch_size=1)
    assert one.pop("nfe") > a["nfe"]  # forwards are counted per batch; the numbers are the same
    assert one == {key: v for key, v in a.items() if key != "nfe"}
    assert a["k"] == 4 and a["prompts"] == 9
    assert 0.0 <= a["mean@4"] <= a["best@4"] <= 1.0 and 0.0 <= a["maj@4"] <= 1.0
    assert 0.0 < a["mean@4"] < a["best@4"]  # some samples right, some prompts rescued by another sample
    # another step draws other samples (the seed names the step)
    assert validate(build_engine("native", model), tok, rows, params, k=4, seed=7, step=4, batch_size=7) != a


def test_validate_samples_k_distinct_draws_per_prompt(setup, monkeypatch):
    """The k samples of a prompt use k different generators: with k = 8 some prompt gets two
    different first characters."""
    model, tok, rows, params = setup
    seen = []

    def recording(text, ground_truth, extra=None):
        seen.append(text)
        return first_char_reward(text, ground_truth, extra)

    monkeypatch.setitem(REWARDS, FIRST_CHAR, recording)
    validate(build_engine("native", model), tok, rows[:2], params, k=8, seed=0, step=0, batch_size=16)
    assert len(seen) == 16 and len(set(seen[:8])) > 1


def test_validate_errors(setup):
    model, tok, rows, params = setup
    with pytest.raises(ValueError, match="k >= 1"):
        validate(build_engine("native", model), tok, rows, params, k=0, seed=0, step=0, batch_size=4)
    with pytest.raises(ValueError, match="at least one prompt"):
        validate(build_engine("native", model), tok, [], params, k=2, seed=0, step=0, batch_size=4)


def test_validate_samples_through_the_engine_it_is_given(setup):
    """Every sample comes from the engine (rl.sampler.engine in the RL loop), not from a loop of its own."""
    model, tok, rows, params = setup
    engine = RecordingEngine(model)
    assert validate(engine, tok, rows, params, k=2, seed=7, step=3, batch_size=5) == \
        validate(build_engine("native", model), tok, rows, params, k=2, seed=7, step=3, batch_size=5)
    assert engine.prompts == [tok.encode(r["prompt_text"]) for r in rows for _ in range(2)]
