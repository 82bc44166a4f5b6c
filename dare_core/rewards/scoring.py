"""Scoring responses with the reward of each row: RL rewards, in-loop validation and the `task`
benchmark all grade through here, so "correct" means the same thing everywhere.

Which reward grades a row, first match wins:
1. the configured one (rl.reward, with rl.reward_args) unless it is "auto";
2. the row's own `reward` column (a name or `module:function`), with its `reward_args` column;
3. a reward named like the row's task (with the row's `reward_args`, if it has them).
Data preparation fills the `reward` column of every row it writes (a synthetic task's from its
registration, `dare_core.data.sources`), so prepared rows always match at 1 or 2.

A response whose grading fails (a run of the code sandbox that times out, crashes, floods or sends
an unusable result; a built-in reward's parser raising on odd text) scores 0 with `extra["failure"]`
(and `extra["error"]`), counted by `failure_metrics` in the RL step metrics. A user's own function
that fails (raises, returns no finite number, times out: `UserRewardFault`, marked
`extra["user_code"]`) is the reward's fault, not the response's: `score_texts` stops the batch with
`RewardFailed` (one line: the function, the row, the exception) once such faults pass
`errors_allowed` (a share of the batch; 0 by default), and at the first non-number whatever the share,
so a broken reward never trains or scores on quiet zeros. What is not a response's fault raises too: no sandbox (`SandboxUnavailable`), an unknown reward, bad
reward options (`RewardError`), a row without a reward. Code rewards of a batch run concurrently,
`workers` at a time (default: $DARE_REWARD_WORKERS, else the usable CPU cores shared among the
host's ranks); each program runs in its own jailed process, so the threads only wait on pipes.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional, Sequence

from dare_core.errors import UserError
from dare_core.rewards.base import (FAILURE_REASONS, RewardFailed, RewardResult, RewardSampleError, UserRewardFault,
                                    UserRewardMalformed)
from dare_core.rewards.registry import REWARDS, get_reward
from dare_core.rewards.sandbox import SandboxUnavailable, check_available

WORKERS_ENV = "DARE_REWARD_WORKERS"
# rewards that run the candidate's program in the sandbox: seconds per response, scored concurrently
SANDBOXED_REWARDS = frozenset({"code"})


def parse_reward_args(text: Optional[str]) -> dict:
    """A `reward_args` column (JSON object text) as a dict; {} for none."""
    if not text:
        return {}
    try:
        args = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"column 'reward_args' is not JSON ({exc}): {text!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"column 'reward_args' must be a JSON object, got {text!r}")
    return args


def row_reward_args(row: dict) -> dict:
    """The options of the row's own reward, from its `reward_args` column; {} when it has none."""
    try:
        return parse_reward_args(row.get("reward_args"))
    except ValueError as exc:
        raise ValueError(f"row {row.get('uid')}: {exc}") from None


def reward_for(row: dict, configured: str = "auto", configured_args: Optional[Mapping[str, Any]] = None) -> tuple[str, dict]:
    """(reward name or `module:function`, its options) that grade `row` (see the module docstring)."""
    if configured != "auto":
        return configured, dict(configured_args or {})
    if row.get("reward"):
        return row["reward"], row_reward_args(row)
    task = row.get("task", "")
    if task in REWARDS:
        return task, row_reward_args(row)
    raise ValueError(f"row {row.get('uid')}: no reward for task '{task}' (set rl.reward explicitly)")


def reward_name_for(row: dict, configured: str = "auto") -> str:
    """The reward of a row: the configured one, else the row's `reward` column, else its task's."""
    return reward_for(row, configured)[0]


def score_row(row: dict, text: str, reward: str = "auto", reward_args: Optional[Mapping[str, Any]] = None) -> RewardResult:
    """Grade one response against `row["ground_truth"]` with the row's reward (a failure of this
    response's grading scores 0 with its reason, as in `score_texts`; a fault of a user's function
    raises RewardFailed: one response is all there is)."""
    name, args = reward_for(row, reward, reward_args)
    result = _graded(get_reward(name, args), row, text)
    if result.extra.get("user_code"):
        raise RewardFailed(result.extra["error"])
    return result


def default_workers() -> int:
    """Concurrent sandboxed rewards: $DARE_REWARD_WORKERS, else the CPU cores this process may use
    divided among the host's ranks (LOCAL_WORLD_SIZE), so that jails never queue for a core (their
    wall-clock limit would then fail programs that are merely waiting)."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"${WORKERS_ENV} must be a whole number >= 1, got {value!r}")
        return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, cores // max(1, int(ranks) if ranks.isdigit() else 1))


def _failed(exc: BaseException) -> RewardResult:
    reason = getattr(exc, "failure", "exception")  # a user's reward that timed out: "timeout"
    if isinstance(exc, UserRewardFault):  # its message names the function, the row and the exception
        return RewardResult(0.0, 0.0, None, {"failure": reason, "error": str(exc)[:500], "user_code": True,
                                             "malformed": isinstance(exc, UserRewardMalformed)})
    return RewardResult(0.0, 0.0, None, {"failure": reason, "error": f"{type(exc).__name__}: {exc}"[:300]})


class _FaultLimit:
    """Counts a batch's user-code faults as they come and raises RewardFailed past the allowed share."""

    def __init__(self, n: int, errors_allowed: float, setting: str):
        if not 0.0 <= errors_allowed <= 1.0:
            raise ValueError(f"errors_allowed must be a share in [0, 1], got {errors_allowed}")
        self.n, self.share, self.setting = n, errors_allowed, setting
        self.allowed, self.count = int(errors_allowed * n), 0

    def see(self, result: RewardResult) -> None:
        if not result.extra.get("user_code"):
            return
        self.count += 1
        if result.extra.get("malformed") or self.count > self.allowed:
            why = ("a reward must return a finite number" if result.extra.get("malformed")
                   else f"{self.count} of {self.n} responses so far, {self.setting} {self.share:g}")
            raise RewardFailed(f"{result.extra['error']} ({why})")


def _graded(fn: Callable, row: dict, text: str) -> RewardResult:
    """One response's result; an exception of its own scoring is a 0 with the reason."""
    try:
        return fn(text, row["ground_truth"], {"task": row.get("task"), "row": row})
    except SandboxUnavailable:
        raise
    except RewardSampleError as exc:
        return _failed(exc)
    except UserError:  # a reward option or the reward itself is wrong: every response would fail
        raise
    except Exception as exc:  # noqa: BLE001  (a parser's bug on odd text, a bad ground truth, ...)
        return _failed(exc)


def score_texts(rows: Sequence[dict], texts: Sequence[str], reward: str = "auto",
                reward_args: Optional[Mapping[str, Any]] = None, *, workers: Optional[int] = None,
                errors_allowed: float = 0.0, setting: str = "errors_allowed") -> list[RewardResult]:
    """Grade `texts[i]` against `rows[i]`, results in input order (see the module docstring). More
    than `errors_allowed` (a share of the batch) faults of a user's function raise RewardFailed, as
    soon as they happen (a reward that times out on every response stops at the first); `setting`
    is the name the error gives the share (e.g. rl.reward_errors_allowed)."""
    if len(rows) != len(texts):
        raise ValueError(f"score_texts: {len(rows)} rows but {len(texts)} texts")
    rewards: dict[tuple, Callable] = {}
    graders, sandboxed = [], []
    for i, row in enumerate(rows):  # every reward resolved first: a configuration error raises at once
        name, args = reward_for(row, reward, reward_args)
        key = (name, json.dumps(args, sort_keys=True, default=repr))
        if key not in rewards:
            rewards[key] = get_reward(name, args)
        graders.append(rewards[key])
        if name in SANDBOXED_REWARDS:
            sandboxed.append(i)
    if sandboxed:
        check_available()  # once per process: without a sandbox no response is graded at all
    workers = default_workers() if workers is None else workers
    results: list[Optional[RewardResult]] = [None] * len(rows)
    limit = _FaultLimit(len(rows), errors_allowed, setting)
    pool = ThreadPoolExecutor(min(workers, len(sandboxed)), "reward") if workers > 1 and len(sandboxed) > 1 else None
    try:
        futures = {i: pool.submit(_graded, graders[i], rows[i], texts[i]) for i in sandboxed} if pool else {}
        for i in range(len(rows)):  # the rest (and every response without a pool) on this thread, meanwhile
            if i not in futures:
                results[i] = _graded(graders[i], rows[i], texts[i])
                limit.see(results[i])
        for i, future in futures.items():
            results[i] = future.result()
            limit.see(results[i])
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return results


def failure_metrics(results: Sequence[RewardResult]) -> dict[str, float]:
    """Step metrics: `reward_failed`, the fraction of responses whose grading could not complete, and
    `reward_failed/<reason>` per reason of FAILURE_REASONS (all of them, so every rank logs the same keys)."""
    n = max(len(results), 1)
    reasons = [r.extra.get("failure") for r in results]
    out = {"reward_failed": sum(1 for x in reasons if x) / n}
    out.update({f"reward_failed/{reason}": reasons.count(reason) / n for reason in FAILURE_REASONS})
    return out
