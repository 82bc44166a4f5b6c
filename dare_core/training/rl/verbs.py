"""The verbs of an RL step, each one named function over the run's shared parts (`RLRun`):

    collect   this step's prompts -> rollouts, rewards, advantages (`Rollout`)
    score     no-grad scores of the rollouts: the old policy's and the reference's (`Scores`)
    optimize  num_iterations x mini-batches x micro-batches of updates and engine steps (`Update`)
    sync      the rollout engine gets the new weights; the reference is synced when due

A schedule (training/rl/schedules.py) is the order it calls them in."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from dare_core.algorithms.rollout import RolloutContext, RolloutSpec, prompt_rows_expanded
from dare_core.batch import Batch
from dare_core.config import LaunchConfig, RLConfig
from dare_core.data.batching import global_batch_indices
from dare_core.rl_schedules import RL_SCHEDULES
from dare_core.sampling.completions import DecodeShare
from dare_core.timing import PhaseTimer
from dare_core.training import engine as eng
from dare_core.training.parallel import from_group_first, layout
from dare_core.training.reference import reference_model, sync_reference
from dare_core.metric_keys import is_max_metric
from dare_core.training.rl.ranks import rank_prompts

if TYPE_CHECKING:  # types only: deepspeed and transformers cost seconds to import
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from dare_core.algorithms.base import RLAlgorithm
    from dare_core.sampling.rollout_engine import RolloutEngine


@dataclass
class RLRun:
    """What every verb reads: built once by the stage, the same for each step. Of the config only
    the sections the verbs read: the RL settings, the run seed and the launch (whole weights or
    partitions for rollouts)."""

    rl: RLConfig
    seed: int
    launch: LaunchConfig
    algo: RLAlgorithm
    engine: DeepSpeedEngine  # engine.module is the policy
    rollout_engine: RolloutEngine  # it decodes; `engine` trains
    tokenizer: PreTrainedTokenizerBase
    rows: list[dict]  # the RL prompts
    ref: Optional[torch.nn.Module]  # the frozen reference copy (None: no KL, or LoRA's adapter-disabled policy)
    micro: int  # rows per forward and per update micro-batch
    timer: PhaseTimer
    rank: int = 0  # this rank's data-parallel unit (its sequence-parallel group: training/parallel.py)
    world: int = 1  # the data-parallel units

    @property
    def zero3(self) -> bool:
        return self.engine.zero_optimization_stage() >= 3


@dataclass
class Rollout:
    """One step's prepared rollouts on this rank. `behaviour`: the old scores, taken at collection
    by the weights that rolled out, where the update happens under other weights (off-policy)."""

    step: int
    prompts: int  # this rank's prompts
    batch: Batch
    metrics: dict
    seconds: float  # the rollout's time, less the reward
    behaviour: Optional[list] = None


@dataclass
class Scores:
    """Per inner iteration: the corruption, and the old and reference scores on it (None: not used)."""

    corruptions: list
    old: Optional[list]
    ref: Optional[list]


@dataclass
class Update:
    """A step's update metrics: per key (sum of micro-batch value x weight, weight), and the losses' sum."""

    metrics: dict = field(default_factory=dict)
    loss: float = 0.0


def ratio_is_trivial(rl: RLConfig) -> bool:
    """Where the update starts at the weights that rolled out (the schedule's record:
    `skips_old_scores`), with one iteration and one mini-batch it sees exactly those weights: the
    ratio is 1 and no old scores are needed. Off-policy, the old scores are the behaviour
    policy's, never the current weights'."""
    return RL_SCHEDULES.lookup(rl.schedule).skips_old_scores and rl.num_iterations == 1 and rl.mini_batches == 1


def first_iteration_is_current(rl: RLConfig) -> bool:
    """Where the update starts at the weights that rolled out, with one mini-batch the first inner
    iteration updates from them (the optimizer first steps at its end): its old scores are the
    update's own scores, detached, and need no forward of their own. Later iterations, and
    mini-batches after the first, see stepped weights and read scored ones."""
    return RL_SCHEDULES.lookup(rl.schedule).skips_old_scores and rl.mini_batches == 1


def chunked_scores(algo, model, batch: Batch, corruption, rows: int) -> torch.Tensor:
    """`algo.score` of the whole batch, `rows` sequences per forward (the update's micro-batch): the
    scores' logits over the vocabulary would otherwise be held for every rollout at once."""
    parts = [algo.score(model, batch.select(idx), corruption.select(idx)) for idx in torch.arange(len(batch)).split(rows)]
    return torch.cat(parts)


def reference_scores(algo, policy, ref, batch: Batch, corruptions: list, rows: int) -> list:
    """Reference-policy scores on the same corruptions (training/reference.py: a frozen copy, or
    with LoRA the policy with its adapter disabled)."""
    with reference_model(policy, ref) as model:
        return [chunked_scores(algo, model, batch, c, rows) for c in corruptions]


def ref_sync_due(step: int, every: int) -> bool:
    """After RL step `step` (0-based) completes: is the reference synced (every `every` steps)?"""
    return every > 0 and (step + 1) % every == 0


def group_decode_share() -> Optional[DecodeShare]:
    """The rollouts' split over this rank's sequence-parallel group: each rank decodes a share of
    the group's prompts and all get every share (None without sequence parallelism)."""
    lay = layout()
    if lay.sp_size == 1:
        return None

    def gather(mine: list) -> list:
        out: list = [None] * lay.sp_size
        torch.distributed.all_gather_object(out, mine, group=lay.sp_group)
        return out

    return DecodeShare(lay.sp_rank, lay.sp_size, gather)


def collect(run: RLRun, step: int) -> Rollout:
    """Rollouts of step `step`'s prompts with the rollout engine's current weights, then rewards and
    advantages (`algo.prepare`). Every rank draws the same prompts and keeps its own share, whole
    prompts (`rank_prompts`), a sequence-parallel group one share. Call inside `eng.rollout_weights`."""
    rl = run.rl
    t0 = time.time()
    idx = global_batch_indices(step, rl.prompts_per_step, len(run.rows), run.seed)
    prompt_rows = [run.rows[i] for i in idx]
    mine = [prompt_rows[i] for i in rank_prompts(len(prompt_rows), rl.mini_batches, run.rank, run.world)]
    with run.timer.phase("rollout"):  # less the reward, timed inside
        # a sequence-parallel group's ranks decode a share of its prompts each (group_decode_share)
        spec = dataclasses.replace(RolloutSpec.of(rl, run.seed, step), share=group_decode_share())
        batch, metrics = run.algo.rollout(run.rollout_engine, run.tokenizer, mine, spec)
    seconds = time.time() - t0
    with run.timer.phase("reward"):
        context = RolloutContext(run.tokenizer, prompt_rows_expanded(mine, rl.group_size), rl.reward, rl.reward_args,
                                 rl.reward_errors_allowed)
        metrics.update(run.algo.prepare(batch, context))
    if layout().sp_size > 1:
        # the ranks of a sequence-parallel group hold the same decoded rollouts; they all keep the
        # first one's rewarded batch, so that the scores they sum are of the same sequences and
        # advantages even where a reward is not reproducible (a code reward's time limit)
        shared, metrics = from_group_first((batch.to("cpu"), metrics))
        batch = shared.to(batch.input_ids.device)
    return Rollout(step, len(mine), batch, metrics, seconds)


def score(run: RLRun, rollout: Rollout, old: bool = True, ref: bool = True, first_old: bool = True) -> Scores:
    """No-grad scores of the rollout, on the corruptions of each inner iteration (drawn from the run
    seed, the rollout's step and the iteration): the current weights' (`old`; `first_old` off: not
    for the first iteration, whose entry is None, see `first_iteration_is_current`) and the
    reference's (`ref`, where the KL term reads it). Call inside `eng.rollout_weights`."""
    rl, engine = run.rl, run.engine
    with run.timer.phase("scoring"), torch.no_grad():
        corruptions = [run.algo.corrupt(rollout.batch, (run.seed, rollout.step, it)) for it in range(rl.num_iterations)]
        olds = [None if it == 0 and not first_old else chunked_scores(run.algo, engine.module, rollout.batch, c, run.micro)
                for it, c in enumerate(corruptions)] if old else None
        refs = (reference_scores(run.algo, engine.module, run.ref, rollout.batch, corruptions, run.micro)
                if ref and rl.kl_beta > 0 else None)
    return Scores(corruptions, olds, refs)


def optimize(run: RLRun, rollout: Rollout, scores: Scores) -> Update:
    """num_iterations passes over the rollouts, each in rl.mini_batches mini-batches of this rank's
    rows, each in micro-batches: one forward/backward and one engine step per micro-batch (the
    engine steps the optimiser at each mini-batch's last)."""
    rl, algo, engine, timer = run.rl, run.algo, run.engine, run.timer
    batch, corruptions, old, ref = rollout.batch, scores.corruptions, scores.old, scores.ref
    update = Update()
    local_mini = len(batch) // rl.mini_batches

    def backward(loss: torch.Tensor) -> None:  # a share of a global-denominator sum
        eng.backward_global(engine, loss)

    for it in range(rl.num_iterations):
        for mb in torch.arange(len(batch)).split(local_mini):
            # normalisers over the whole mini-batch (all micro-batches, all ranks) before any backward
            denom = eng.all_reduce_sum(algo.denominator(batch.select(mb), corruptions[it].select(mb)))
            for mc in mb.split(run.micro):
                o = old[it][mc] if old is not None and old[it] is not None else None  # None: the update's own, detached
                r = ref[it][mc] if ref is not None else None
                with timer.phase("forward_backward"):
                    out = algo.update(engine.module, batch.select(mc), corruptions[it].select(mc), o, r, denom, backward)
                with timer.phase("optimizer"):
                    engine.step()
                # the micro-batch's metrics weigh by its share of the loss normaliser (scored
                # tokens for a token mean, sequences for a sequence mean): the step's token or
                # sequence mean whatever the micro-batches and ranks
                weight = float(algo.denominator(batch.select(mc), corruptions[it].select(mc))[0])
                for k, v in out.metrics.items():
                    if is_max_metric(k):
                        update.metrics[k] = (max(update.metrics.get(k, (v, 1.0))[0], v), 1.0)
                        continue
                    s, w = update.metrics.get(k, (0.0, 0.0))
                    update.metrics[k] = (s + v * weight, w + weight)
                update.loss += float(out.loss)
    return update


def sync(run: RLRun, step: int) -> None:
    """After step `step`'s update: the next rollout must see its weights, and the next step's KL is
    to this step's policy where a reference sync is due."""
    # an engine with its own copy gets the policy's weights over; under ZeRO-3 they are gathered for
    # it first (every rank enters: a collective); one that decodes the policy itself needs nothing
    with run.timer.phase("weight_sync"), eng.whole_weights(run.engine, needed=not run.rollout_engine.decodes_policy):
        run.rollout_engine.update_weights(run.engine.module)
    if run.ref is not None and ref_sync_due(step, run.rl.ref_sync_steps):
        sync_reference(run.ref, run.engine.module, run.zero3)
