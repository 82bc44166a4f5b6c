"""k samples per held-out prompt, graded by each row's task reward: mean@k, best@k and maj@k.

In-loop RL validation (`rl.validate_every`) grades the val split. Every sample's noise comes from a
generator derived from (seed, "val", step, uid, sample index), so the numbers are reproducible and do
not depend on the batch size, on which prompts share a batch or on which rank samples a prompt: with
several ranks each samples its share (`sample_groups`), and the prompts' `prompt_at_k` scores, put
back in prompt order, give the one-rank numbers (`at_k_of_prompts`). Sampling goes through the
configured rollout engine (`sampling/completions.py`), as the RL rollouts do.
"""
from __future__ import annotations

from typing import Optional, Sequence

from dare_core.rewards import RewardResult
from dare_core.rewards.grading import grade
from dare_core.sampling.completions import generate
from dare_core.sampling.rollout_engine import RolloutEngine
from dare_core.sampling.params import SamplingParams

# one graded sample: the reward's result and the decoded response it graded
Sample = tuple[RewardResult, str]


def answer_of(result: RewardResult, text: str) -> str:
    """What a sample votes for in maj@k: the answer the reward extracted, else the whole response
    (stripped), so that samples the reward could not parse only agree when they are the same text."""
    return result.pred if result.pred is not None else text.strip()


def prompt_at_k(group: Sequence[Sample]) -> tuple[float, float, float]:
    """One prompt's (mean, best, maj) over its k samples (`at_k_metrics`)."""
    accs = [result.acc for result, _ in group]
    votes: dict[str, list] = {}  # answer -> [count, acc of its first sample]; dicts keep first-seen order
    for result, text in group:
        vote = votes.setdefault(answer_of(result, text), [0, result.acc])
        vote[0] += 1
    # max() returns the first maximal entry, i.e. the answer that appeared first among the tied
    return sum(accs) / len(group), max(accs), max(votes.values(), key=lambda v: v[0])[1]


def at_k_of_prompts(scores: Sequence[tuple[float, float, float]], k: int) -> dict[str, float]:
    """mean@k, best@k and maj@k from the prompts' `prompt_at_k`, summed in the order given (the
    prompts' order: the same numbers, to the last bit, however the prompts were shared out)."""
    if not scores:
        raise ValueError("at_k_metrics needs at least one prompt")
    mean = best = maj = 0.0
    for m, b, v in scores:
        mean += m
        best += b
        maj += v
    n = len(scores)
    return {f"mean@{k}": mean / n, f"best@{k}": best / n, f"maj@{k}": maj / n}


def at_k_metrics(groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
    """mean@k, best@k and maj@k averaged over prompts; `groups` holds the k samples of each prompt.

    mean@k: mean acc of the k samples; best@k: the best acc among them (1 if any is correct);
    maj@k: acc of the most frequent answer (`answer_of`), ties going to the answer seen first."""
    if not groups:
        raise ValueError("at_k_metrics needs at least one prompt")
    k = len(groups[0])
    if k == 0 or any(len(g) != k for g in groups):
        raise ValueError(f"every prompt needs the same number k >= 1 of samples, got {sorted({len(g) for g in groups})}")
    return at_k_of_prompts([prompt_at_k(g) for g in groups], k)


def sample_groups(engine: RolloutEngine, tokenizer, rows: Sequence[dict], params: SamplingParams, k: int, seed: int,
                  step: int, batch_size: int, reward: str = "auto", reward_args: Optional[dict] = None,
                  errors_allowed: float = 0.0
                  ) -> tuple[list[list[Sample]], int]:
    """The k graded samples of every row (a list per row, in row order) and the forward passes the
    sampling took. The engine's model is left in the train/eval mode it came in."""
    if k < 1:
        raise ValueError(f"validation needs k >= 1 samples per prompt, got {k}")
    if not rows:
        raise ValueError("validation needs at least one prompt")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = [tokenizer.encode(row["prompt_text"]) for row in rows]
    samples = [(i, j) for i in range(len(rows)) for j in range(k)]  # a prompt's k samples are adjacent
    seeds = [(seed, "val", step, rows[i]["uid"], j) for i, j in samples]
    done = generate(engine, tokenizer, [prompts[i] for i, _ in samples], params, seeds, batch_size)
    results = grade([rows[i] for i, _ in samples], done.texts, reward, reward_args, errors_allowed).results
    graded = list(zip(results, done.texts))
    return [graded[i:i + k] for i in range(0, len(graded), k)], done.nfe


def validate(engine: RolloutEngine, tokenizer, rows: Sequence[dict], params: SamplingParams, k: int, seed: int, step: int,
             batch_size: int, reward: str = "auto", reward_args: Optional[dict] = None) -> dict:
    """Sample k responses to every row through `engine`, grade them with the row's reward and return
    `at_k_metrics` plus `k`, `prompts` and `nfe`. The engine's model is left in the train/eval mode it
    came in."""
    groups, nfe = sample_groups(engine, tokenizer, rows, params, k, seed, step, batch_size, reward, reward_args)
    return {**at_k_metrics(groups), "k": k, "prompts": len(rows), "nfe": nfe}
