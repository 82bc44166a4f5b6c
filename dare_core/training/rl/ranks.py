"""RL on several ranks: which prompts each rank rolls out (whole groups, so group advantages never
span ranks), and how the ranks' shares of a step's metrics combine into the step's metrics."""
from __future__ import annotations

import math

from dare_core.metric_keys import is_max_metric
from dare_core.training import engine as eng


def rank_prompts(n_prompts: int, mini_batches: int, rank: int, world: int) -> list[int]:
    """Positions, in the step's prompt order, of the prompts rank `rank` of `world` rolls out. Every
    prompt is on exactly one rank together with all its rows (its G rollouts, or its d-TreeRPO
    tree's transitions), so group advantages are over whole groups by construction. When the
    mini-batches hold whole prompts, as many on each rank (n_prompts / mini_batches divisible by
    `world`), a rank takes every world-th prompt of each mini-batch in turn: the ranks' local
    mini-batch m together are the one-rank mini-batch m, the same updates as on one rank. Otherwise
    (a mini-batch cuts through a group, or holds fewer prompts than ranks) every world-th prompt of
    the step: the ranks' slices still partition the rows into mini-batches, just not as one rank
    does. (`check_rl_ranks`: n_prompts divisible by `world`.)"""
    per_mini = n_prompts // mini_batches
    if n_prompts % mini_batches or per_mini % world:
        return list(range(rank, n_prompts, world))
    return [m * per_mini + i for m in range(mini_batches) for i in range(rank, per_mini, world)]


# How a step's metrics combine over the ranks, each having measured its own share of the step
# (`combine_rank_metrics`). Totals: forward passes of the rollouts and what they encoded, rollout throughput, d-TreeRPO's
# distillation pairs. The same on every rank (rank 0's): the learning rate and d-TreeRPO's schedule
# and tree size. The slowest rank: times (`*_s`) and peak memory. Anything else (reward, accuracy,
# extraction_failed, response_tokens, sequence_tokens, rollout_steps, zero_std_ratio, reward_std,
# active_tokens, adv_abs, an algorithm's own rollout metrics) is a mean over the ranks weighted by their prompts
# (each prompt yields as many rollouts, groups and rows on every rank). The update metrics (loss
# and those of `algo.update`) are reduced apart (`combine_rank_metrics`).
RANK_SUM_METRICS = frozenset({"rollout_nfe", "rollout_tokens_per_s", "rollout_encoded_tokens", "rollout_key_pairs",
                              "rollout_logit_tokens", "sd_pairs"})
RANK_SAME_METRICS = frozenset({"lr", "sd_lambda", "tree_transitions", "tree_leaves"})


def _rank_rule(key: str) -> str:
    if key in RANK_SUM_METRICS:
        return "sum"
    if key in RANK_SAME_METRICS:
        return "same"
    if key.endswith("_s") or key.startswith("memory/"):
        return "max"
    return "mean"


def combine_rank_metrics(parts: list[dict], loss_terms: int = 1) -> dict:
    """One step's metrics from every rank's part, in rank order. A part: `prompts` (its share),
    `metrics` (rollout, prepare and timing metrics of its share; `_rank_rule` says how each
    combines), `updates` ({key: (sum of value x weight, sum of weight)} over its micro-batches, the
    weight a micro-batch's first loss normaliser, `algo.denominator`: combined, the weighted mean
    over all ranks' micro-batches; for a token-mean algorithm the mean over the step's scored
    tokens, as one rank computes it) and `loss` (the sum of its micro-batch losses, each its share
    of a mini-batch loss normalised by the global denominator: the ranks' sum over `loss_terms` =
    num_iterations x mini_batches is the step's mean mini-batch loss, whatever the ranks and
    micro-batches). A metric a rank lacks (e.g. d-TreeRPO's sd_kl when its
    share had no distillation pair) combines over the ranks that have it. With one part, its
    `metrics` are returned as they are."""
    out: dict = {}
    keys = list(dict.fromkeys(k for p in parts for k in p["metrics"]))
    for key in keys:
        have = [(p["prompts"], p["metrics"][key]) for p in parts if key in p["metrics"]]
        rule = _rank_rule(key)
        if len(have) == 1 or rule == "same":
            out[key] = have[0][1]
        elif rule == "sum":
            values = [v for _, v in have]
            out[key] = sum(values) if all(isinstance(v, int) for v in values) else math.fsum(values)
        elif rule == "max":
            out[key] = max(v for _, v in have)
        else:
            out[key] = math.fsum(n * v for n, v in have) / math.fsum(n for n, _ in have)
    if any("loss" in p for p in parts):
        out["loss"] = math.fsum(p.get("loss", 0.0) for p in parts) / max(loss_terms, 1)
    ukeys = list(dict.fromkeys(k for p in parts for k in p.get("updates", {})))
    for key in ukeys:
        have = [p["updates"][key] for p in parts if key in p.get("updates", {})]
        if is_max_metric(key):  # (max, 1.0) on each rank
            out[key] = max(s for s, _ in have)
        else:
            out[key] = math.fsum(s for s, _ in have) / max(math.fsum(w for _, w in have), 1e-12)
    return out


def reduce_step_metrics(part: dict, loss_terms: int = 1) -> dict:
    """`combine_rank_metrics` of every rank's `part` (gathered: the same result on every rank)."""
    return combine_rank_metrics(eng.all_gather_objects(part), loss_terms)
