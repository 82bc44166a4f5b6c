"""The RL loop: rollout -> reward -> group advantages -> corruptions -> old/ref scores ->
num_iterations x mini-batch PPO updates -> log -> checkpoint (ALGORITHMS.md 5)."""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from dare_core import devices
from dare_core.algorithms.registry import build_algorithm
from dare_core.algorithms.rollout import RolloutContext, RolloutSpec, prompt_rows_expanded
from dare_core.batch import Batch
from dare_core.artifacts import artifact_root
from dare_core.config import ConfigError, DareConfig
from dare_core.data.batching import global_batch_indices
from dare_core.data.lengths import resolve as resolve_lengths
from dare_core.data.schema import DataError, check_ground_truths, read_rows, table_row
from dare_core.devices import resolve_dtype
from dare_core.models.hf_folder import inspect_model, load_model
from dare_core.rl_rules import check_rl_config
from dare_core.sampling.cache import check_cache_fits
from dare_core.sampling.engines import build_engine
from dare_core.storage import atomic_write_json
from dare_core.timing import PhaseTimer, phase_times_requested
from dare_core.training import engine as eng
from dare_core.training.checkpoint import CheckpointManager, SavePolicy, stage_fingerprint
from dare_core.training.metrics import MetricsLogger
from dare_core.training.plots import STAGE_PLOTS
from dare_core.training.preflight import check_outputs, checkpoint_bytes, model_bytes, stage_writes, training_need
from dare_core.training.rl_ranks import rank_prompts, reduce_step_metrics
from dare_core.training.rl_validation import RLValidator, due
from dare_core.training.setup import prepare_for_training, stage_tokenizer

log = logging.getLogger(__name__)


def rl_start_folder(cfg: DareConfig) -> Path:
    """RL starts from the SFT stage's exported model."""
    return cfg.stage_dir("sft") / "model"


def chunked_scores(algo, model, batch: Batch, corruption, rows: int) -> torch.Tensor:
    """`algo.score` of the whole batch, `rows` sequences per forward (the update's micro-batch): the
    scores' logits over the vocabulary would otherwise be held for every rollout at once."""
    parts = [algo.score(model, batch.select(idx), corruption.select(idx)) for idx in torch.arange(len(batch)).split(rows)]
    return torch.cat(parts)


def reference_scores(algo, policy, ref, batch: Batch, corruptions: list, rows: int) -> list:
    """Reference-policy scores on the same corruptions: a frozen copy, or (LoRA) the policy with its
    adapter disabled, in eval mode."""
    if ref is not None:
        return [chunked_scores(algo, ref, batch, c, rows) for c in corruptions]
    from dare_core.models.lora import adapter_disabled

    was_training = policy.training
    policy.eval()
    with adapter_disabled(policy):
        scores = [chunked_scores(algo, policy, batch, c, rows) for c in corruptions]
    policy.train(was_training)
    return scores


def sync_reference(ref: torch.nn.Module, policy: torch.nn.Module, zero3: bool = False) -> None:
    """rl.ref_sync_steps: the frozen reference copy becomes the current policy, in place (its
    parameters and buffers; ALGORITHMS.md 5.1.7). `policy` is the engine's module, whose weights
    are what the scores use (under bf16 the module's bf16 weights, not the optimiser's fp32
    master copy). Under ZeRO-3 each parameter is partitioned across the ranks: it is gathered, one
    at a time (no rank holds more than the reference plus one full parameter), and copied; ZeRO
    0-2 keep every parameter whole on every rank."""
    ref_params, ref_buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
    with torch.no_grad():
        for name, p in policy.named_parameters():
            with eng.gathered([p], zero3):
                ref_params[name].copy_(p)
        for name, b in policy.named_buffers():
            if name in ref_buffers:
                ref_buffers[name].copy_(b)


def ref_sync_due(step: int, every: int) -> bool:
    """After RL step `step` (0-based) completes: is the reference synced (every `every` steps)?"""
    return every > 0 and (step + 1) % every == 0


def _val_postfix(val_metrics: dict) -> dict:
    """The progress bar's view of the last validation: its maj@k."""
    return {key.split("/")[1]: f"{v:.3f}" for key, v in val_metrics.items() if key.startswith("val/maj@")}


# rl.validate_*: validation neither draws from the training randomness nor changes the weights, so
# changing them resumes the run (left out of the fingerprint, like the keys of COSMETIC_KEYS)
VALIDATION_KEYS = ("validate_every", "validate_k", "validate_prompts", "validate_temperature")


@dataclass
class RLPlan:
    """What `check_rl` read and decided, before anything is written."""

    rows: list
    validator: RLValidator
    tokenizer: object
    ckpt: CheckpointManager


def _check_sampler(cfg: DareConfig, spec) -> None:
    """The rollout cache must suit the start model's family (block diffusion or not)."""
    try:
        check_cache_fits(cfg.rl.sampler, spec.block_size is not None)
    except ValueError as exc:
        raise ConfigError(f"rl.sampler.cache: {exc} (the model in {rl_start_folder(cfg)} is {spec.family.model_type})") from None


def _check_prompt_lengths(path: Path, rows: list[dict], tokenizer, gen_length: int, limit: int) -> None:
    for i, row in enumerate(rows):
        n = len(tokenizer.encode(row["prompt_text"]))
        if n + gen_length > limit:
            raise DataError(f"{table_row(path, i)}: prompt of {n} tokens + rl.sampler.gen_length {gen_length} "
                            f"exceeds the model maximum {limit}")


def check_rl(cfg: DareConfig, save_checkpoints: bool = True) -> RLPlan:
    """Every check of the RL stage, before it writes anything or starts DeepSpeed: the config, the
    SFT model (its config only) and the sampler's fit to its family, the algorithm's options and
    batch shapes, the prompts and their ground truths (train and val), the checkpoints (made with
    these settings, unless --restart), writable outputs and room on the disk (for the checkpoints
    the save policy writes, if checkpoints will be saved)."""
    rl = cfg.rl
    out_dir = cfg.stage_dir("rl")
    start_folder = rl_start_folder(cfg)
    if not (start_folder / "config.json").is_file():
        raise FileNotFoundError(f"{start_folder}: no SFT model to start from (run the sft stage first)")
    spec = prepare_for_training(inspect_model(start_folder), cfg)
    _check_sampler(cfg, spec)
    algo = build_algorithm(rl, spec)
    check_rl_config(cfg, algo.rows_per_prompt)
    check_rl_ranks(cfg, algo.rows_per_prompt)

    data_path = Path(cfg.data.prepared_dir) / "rl.parquet"
    rows = read_rows(data_path, "rl")
    if not rows:
        raise DataError(f"{data_path}: no prompts to train on")
    check_ground_truths(rows, rl.reward, str(data_path), rl.reward_args)
    # reads the val split now: a missing one fails before the model loads
    validator = RLValidator(cfg, out_dir)
    check_ground_truths(validator.rows, rl.reward, str(Path(cfg.data.prepared_dir) / "val.parquet"), rl.reward_args)
    tokenizer = stage_tokenizer(cfg)
    _check_prompt_lengths(data_path, rows, tokenizer, rl.sampler.gen_length, spec.max_sequence_length)

    fingerprint = stage_fingerprint(cfg, "rl", {"data file": data_path, "start model": start_folder}, VALIDATION_KEYS)
    dtype = resolve_dtype(cfg.model.dtype)
    # no export: `convert` reads the last checkpoint, of the weights only where no resume point is due
    ckpt = CheckpointManager(out_dir / "checkpoints", rl.keep_last, fingerprint, "rl", cfg.restart, checkpoint_bytes(spec, dtype),
                             mirror=artifact_root(cfg), policy=SavePolicy(rl.save_every, rl.num_steps, exports=False),
                             weights_bytes=model_bytes(spec, dtype))
    ckpt.check()
    saves, existing = ckpt.planned_writes() if save_checkpoints else ([], [])
    check_outputs(stage_writes(out_dir) + [Path(cfg.run.metrics_dir) / "rl.json"],
                  [(out_dir, training_need(saves, existing, rl.keep_last, 0))], "the RL checkpoints")
    return RLPlan(rows, validator, tokenizer, ckpt)


def check_rl_ranks(cfg: DareConfig, rows_per_prompt: int) -> None:
    """Each rank walks its own share of every mini-batch, so the shares must be whole."""
    rl = cfg.rl
    mini = rl.prompts_per_step * rows_per_prompt // rl.mini_batches
    ranks = eng.planned_world_size()
    if rl.prompts_per_step % ranks or mini % ranks:
        raise ValueError(f"rl.prompts_per_step = {rl.prompts_per_step} (mini-batch {mini}) must be divisible by the {ranks} ranks")
    # validation runs on every rank (each its share of the val prompts, padded to one length: the
    # same sampling calls everywhere), so ZeRO-3's collective forwards are no obstacle to it


def run_rl(cfg: DareConfig, progress: bool = True, save_checkpoints: bool = True, phase_times: Optional[bool] = None) -> dict:
    """The RL stage. `save_checkpoints` off: no training checkpoints (benchmarks); `phase_times`:
    log where each step's time goes (None: `DARE_PHASE_TIMES` decides; `dare_core.timing`)."""
    cfg = resolve_lengths(cfg)  # `auto` lengths, as the prepare stage derived them
    timer = PhaseTimer(phase_times_requested(phase_times))
    with timer.active():
        return _run_rl(cfg, progress, save_checkpoints, timer)


def _run_rl(cfg: DareConfig, progress: bool, save_checkpoints: bool, timer: PhaseTimer) -> dict:
    rl = cfg.rl
    out_dir = cfg.stage_dir("rl")
    with timer.phase("checks"):
        plan = check_rl(cfg, save_checkpoints)
    rows, validator, tokenizer, ckpt = plan.rows, plan.validator, plan.tokenizer, plan.ckpt

    # every check has passed: from here on the stage may write
    device = devices.device()
    with timer.phase("load"):
        policy = prepare_for_training(load_model(rl_start_folder(cfg), dtype=resolve_dtype(cfg.model.dtype), device=device), cfg)
    ref: Optional[torch.nn.Module] = None
    if rl.kl_beta > 0 and cfg.model.lora is None:
        ref = copy.deepcopy(policy).eval().requires_grad_(False)

    algo = build_algorithm(rl, policy)
    rollouts = rl.prompts_per_step * algo.rows_per_prompt
    mini = rollouts // rl.mini_batches
    local_mini = mini // eng.planned_world_size()
    micro = min(rl.micro_batch_size, local_mini)
    updates = rl.num_steps * rl.num_iterations * rl.mini_batches
    with timer.phase("engine"):
        engine = eng.build_engine(policy, rl.optim, updates, micro, -(-local_mini // micro), cfg.launch)
    world, rank = eng.world_size(), eng.rank()
    sampler = build_engine(rl.sampler.engine, engine.module, **rl.sampler.engine_args)
    start = ckpt.begin(engine, "RL")
    zero3 = engine.zero_optimization_stage() >= 3
    if ref is not None and rl.ref_sync_steps and rl.ref_sync_steps <= start < rl.num_steps:
        # the reference of a resumed run is the policy of its last sync: exact when the checkpoint is
        # a sync step (the checkpoints do not keep the reference)
        sync_reference(ref, engine.module, zero3)
        if start % rl.ref_sync_steps:
            log.warning("rl.ref_sync_steps = %d: resuming at step %d, between two syncs; the reference is the resumed "
                        "policy instead of that of step %d (save_every a multiple of ref_sync_steps makes resumes exact)",
                        rl.ref_sync_steps, start, start - start % rl.ref_sync_steps)
    logger = MetricsLogger(out_dir, resume_step=start, plot_keys=("reward", "accuracy"), enabled=rank == 0,
                           pngs=STAGE_PLOTS["rl"])
    validator.open(start, writer=rank == 0)
    trivial_ratio = rl.num_iterations == 1 and rl.mini_batches == 1
    if trivial_ratio:
        log.warning("num_iterations = 1 with one mini-batch: the ratio is exactly 1 and clipping is inactive")

    bar = tqdm(range(start, rl.num_steps), initial=start, total=rl.num_steps, desc=f"rl[{rl.algorithm}]", disable=not progress or rank != 0, dynamic_ncols=True)
    t_start = time.time()
    val_postfix: dict = {}
    if start == 0:  # the SFT model, before any update (a resumed run validated it already)
        with eng.rollout_weights(engine, cfg.launch, needed=due(0, rl)):
            val_metrics = validator(sampler, tokenizer, 0)
        if val_metrics:
            logger.log(0, val_metrics)
            val_postfix = _val_postfix(val_metrics)
    for step in bar:
        timer.step_begin()
        t0 = time.time()
        # every rank draws the same prompts and keeps its own share, whole prompts (`rank_prompts`)
        idx = global_batch_indices(step, rl.prompts_per_step, len(rows), cfg.run.seed)
        prompt_rows = [rows[i] for i in idx]
        mine = [prompt_rows[i] for i in rank_prompts(len(prompt_rows), rl.mini_batches, rank, world)]
        # rollouts and the no-grad scoring on the whole weights (under ZeRO-3: one gather a step)
        with eng.rollout_weights(engine, cfg.launch):
            with timer.phase("rollout"):  # less the reward, timed inside
                batch, metrics = algo.rollout(sampler, tokenizer, mine, RolloutSpec.of(rl, cfg.run.seed, step))
            t_rollout = time.time() - t0

            with timer.phase("reward"):
                context = RolloutContext(tokenizer, prompt_rows_expanded(mine, rl.group_size), rl.reward, rl.reward_args)
                metrics.update(algo.prepare(batch, context))
            with timer.phase("scoring"), torch.no_grad():
                corruptions = [algo.corrupt(batch, (cfg.run.seed, step, it)) for it in range(rl.num_iterations)]
                old = None if trivial_ratio else [chunked_scores(algo, engine.module, batch, c, micro) for c in corruptions]
                ref_scores = reference_scores(algo, engine.module, ref, batch, corruptions, micro) if rl.kl_beta > 0 else None
        # per key: (sum of micro-batch value x weight, weight); the losses' sum (`combine_rank_metrics`)
        update_metrics: dict[str, tuple[float, float]] = {}
        loss_sum = 0.0
        local_mini = len(batch) // rl.mini_batches

        def backward(loss: torch.Tensor) -> None:  # a share of a global-denominator sum
            eng.backward_global(engine, loss)

        for it in range(rl.num_iterations):
            for mb in torch.arange(len(batch)).split(local_mini):
                # normalisers over the whole mini-batch (all micro-batches, all ranks) before any backward
                denom = eng.all_reduce_sum(algo.denominator(batch.select(mb), corruptions[it].select(mb)))
                for mc in mb.split(micro):
                    o = old[it][mc] if old is not None else None
                    r = ref_scores[it][mc] if ref_scores is not None else None
                    with timer.phase("forward_backward"):
                        out = algo.update(engine.module, batch.select(mc), corruptions[it].select(mc), o, r, denom, backward)
                    with timer.phase("optimizer"):
                        engine.step()
                    # the micro-batch's metrics weigh by its share of the loss normaliser (scored
                    # tokens for a token mean, sequences for a sequence mean): the step's token or
                    # sequence mean whatever the micro-batches and ranks
                    weight = float(algo.denominator(batch.select(mc), corruptions[it].select(mc))[0])
                    for k, v in out.metrics.items():
                        s, w = update_metrics.get(k, (0.0, 0.0))
                        update_metrics[k] = (s + v * weight, w + weight)
                    loss_sum += float(out.loss)
        sampler.update_weights(engine.module)  # the next rollout must see this step's weights
        if ref is not None and ref_sync_due(step, rl.ref_sync_steps):
            sync_reference(ref, engine.module, zero3)  # the next step's KL is to this step's policy
        metrics.update(step_time_s=time.time() - t0, rollout_time_s=t_rollout, lr=engine.get_lr()[0])
        # every rank's share of the step in one set of metrics (the same on every rank)
        metrics = reduce_step_metrics({"prompts": len(mine), "metrics": metrics, "updates": update_metrics, "loss": loss_sum},
                                      rl.num_iterations * rl.mini_batches)
        # before the checkpoint: a run resumed from it must not validate this step again
        with eng.rollout_weights(engine, cfg.launch, needed=due(step + 1, rl)):
            val_metrics = validator(sampler, tokenizer, step + 1)
        metrics.update(val_metrics)
        val_postfix = _val_postfix(val_metrics) or val_postfix
        if (step + 1) % rl.log_every == 0 or step + 1 == rl.num_steps or val_metrics:
            # phase times: the slowest rank's
            logger.log(step + 1, {**metrics, **reduce_step_metrics({"prompts": len(mine), "metrics": timer.step_metrics()})})
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.2f}", **val_postfix)
        if save_checkpoints:
            ckpt.after_step(engine, step + 1, engine.module.hf_config)
    bar.close()
    logger.close()
    summary = {"steps": rl.num_steps, "algorithm": rl.algorithm, "wall_s": round(time.time() - t_start, 1)}
    if validator.history:  # the last validation, beside the run's other headline numbers
        summary["validation"] = validator.history[-1]
    if rank == 0:
        atomic_write_json(Path(cfg.run.metrics_dir) / "rl.json", summary)
    return summary
