"""Reward registry: pure, deterministic functions `(response_text, ground_truth, extra) -> RewardResult`.

`response_text` is the response decoded from ids cut at the first EOS, special tokens skipped.
`extra` is context of the graded row (`task`; `row`, the data row itself, when scored through
`dare_core.eval.scoring`).

A reward is named either by its registered name (`exact_match`) or by a reference to a user's
function, `module:function` (see `dare_core.rewards.user`). Options of a reward are its parameters
after the first three (keyword arguments with defaults, e.g. `exact_match(..., *, case=True)`);
`get_reward(name, args)` binds them, rejecting names the reward does not take.

A reward may also register a cheap validity check of a ground truth (`@ground_truth_check(name)`,
raising ValueError for one the reward could not grade), so that data preparation and the RL stage
reject such a row, naming it, before anything is trained or written. The check receives those of the
reward's options that it takes as parameters. A reward without one accepts every non-empty ground truth.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from dare_core.errors import UserError
from dare_core.registry import Registry

RewardFn = Callable[[str, str, Optional[dict]], "RewardResult"]
GroundTruthCheck = Callable[..., object]

# (response_text, ground_truth, extra): the parameters of every reward that are not options
_POSITIONAL = 3


@dataclass
class RewardResult:
    score: float
    acc: float
    pred: Optional[str]
    extra: dict = field(default_factory=dict)


class RewardError(UserError):
    """A reward that cannot be used as configured: an unknown option or a bad option value, or a
    user's `module:function` that cannot be imported, is not callable, raised while scoring or
    returned something unusable. The message names the reward."""


REWARDS = Registry("reward")
GROUND_TRUTH_CHECKS = Registry("ground-truth check")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    if is_reference(name):  # ':' marks a user's module:function
        raise ValueError(f"reward name {name!r} must not contain ':'")
    return REWARDS.register(name)


def is_reference(name: str) -> bool:
    """True for a user's reward named `module:function` (registered names never contain ':')."""
    return ":" in name


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


def get_reward(name: str, args: Optional[Mapping[str, Any]] = None) -> RewardFn:
    """The reward `name` (registered, or `module:function`) with options `args` bound."""
    args = dict(args or {})
    if is_reference(name):
        from dare_core.rewards.user import user_reward

        return user_reward(name, args)
    fn = REWARDS.lookup(name, hint="or a function of your own as module:function")
    if not args:
        return fn
    check_options(name, fn, args)
    return functools.partial(fn, **args)


def compute_reward(name: str, response_text: str, ground_truth: str, extra: Optional[dict] = None,
                   args: Optional[Mapping[str, Any]] = None) -> RewardResult:
    return get_reward(name, args)(response_text, ground_truth, extra)


def ground_truth_check(name: str) -> Callable[[GroundTruthCheck], GroundTruthCheck]:
    """Register `fn(ground_truth, **options)`, which raises ValueError when reward `name` cannot grade
    against it; it receives those of the reward's options that it names as parameters."""
    return GROUND_TRUTH_CHECKS.register(name)


def check_ground_truth(name: str, ground_truth: str, args: Optional[Mapping[str, Any]] = None) -> None:
    """Raise ValueError when reward `name` with options `args` could not grade responses against
    `ground_truth` (RewardError, a ValueError too, when the reward itself is unusable)."""
    get_reward(name, args)  # unknown name, unknown option, or a reference that does not load
    if is_reference(name):
        from dare_core.rewards.user import check_user_ground_truth

        check_user_ground_truth(name, ground_truth, dict(args or {}))
        return
    check = GROUND_TRUTH_CHECKS.get(name)
    if check is not None:
        check(ground_truth, **accepted_args(check, args or {}))
