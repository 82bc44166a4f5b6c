"""What every reward shares: its result, its error, and which options a reward function takes."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from dare_core.errors import UserError

RewardFn = Callable[[str, str, Optional[dict]], "RewardResult"]
GroundTruthCheck = Callable[..., object]

# (response_text, ground_truth, extra): the parameters of every reward that are not options
_POSITIONAL = 3


@dataclass
class RewardResult:
    score: float
    acc: float
    pred: Optional[str]
    # details of the grading; `failure` (one of FAILURE_REASONS) when it could not complete (the
    # program under test timed out or crashed, the reward raised, ...): the response then scores 0
    extra: dict = field(default_factory=dict)


# why grading a response could not complete (RewardResult.extra["failure"]), counted in the RL metrics
FAILURE_REASONS = ("exception", "timeout", "output_limit", "crashed", "malformed")


class RewardError(UserError):
    """A reward that cannot be used as configured: an unknown option or a bad option value, or a
    user's `module:function` that cannot be imported, is not callable, raised while scoring or
    returned something unusable. The message names the reward."""


class RewardSampleError(RewardError):
    """A reward that failed on one response only (a user's function raised on it, or returned
    something unusable for it): scoring a batch gives that response 0 with the reason and goes on."""

    failure = "exception"  # the reason recorded for the response (FAILURE_REASONS)


class UserRewardFault(RewardSampleError):
    """The user's own reward function failed on one response: it raised, returned something that is
    not a finite number, or outlived its time limit. Unlike a program under test that crashes (the
    response's fault), this is the reward's: a batch stops on it (`scoring.score_texts`)."""


class UserRewardMalformed(UserRewardFault):
    """The user's function returned something that is not a finite number: never a response's fault."""

    failure = "malformed"


class RewardFailed(RewardError):
    """The user's reward failed on more of a batch's responses than allowed: the stage stops with
    this line (the function, the row, the exception)."""


def _signature_keywords(fn: Callable) -> tuple[Optional[frozenset], frozenset]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: they take no options
        return frozenset(), frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None, frozenset()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = frozenset(p.name for p in params if p.kind in keyword)
    options = frozenset(p.name for i, p in enumerate(params) if p.kind in keyword and i >= _POSITIONAL)
    return names, options


_cached_keywords = functools.lru_cache(maxsize=None)(_signature_keywords)


def _parameters(fn: Callable) -> tuple[Optional[frozenset], frozenset]:
    """(every name `fn` takes by keyword, None when it takes **kwargs; those of them past the first
    three parameters, i.e. its options). Cached: rewards are looked up once per graded response."""
    try:
        return _cached_keywords(fn)
    except TypeError:  # an unhashable callable object
        return _signature_keywords(fn)


def reward_options(fn: Callable) -> Optional[frozenset]:
    """The option names reward function `fn` takes (None: any, it takes **kwargs)."""
    names, past = _parameters(fn)
    return None if names is None else past


def accepted_args(fn: Callable, args: Mapping[str, Any]) -> dict:
    """The entries of `args` that `fn` takes as keyword arguments (all of them if it takes **kwargs)."""
    names, _ = _parameters(fn)
    return dict(args) if names is None else {k: v for k, v in args.items() if k in names}


def check_options(label: str, fn: Callable, args: Mapping[str, Any]) -> None:
    """Raise RewardError naming reward `label` when `args` has an option `fn` does not take."""
    options = reward_options(fn)
    if options is None:
        return
    unknown = sorted(set(args) - options)
    if unknown:
        known = ", ".join(sorted(options)) if options else "none"
        raise RewardError(f"reward {label!r}: unknown option(s) {', '.join(map(repr, unknown))}; its options: {known}")
