"""The RL stage: rollout -> reward -> group advantages -> corruptions -> old/ref scores ->
num_iterations x mini-batch PPO updates -> log -> checkpoint (docs/algorithms.md#rl-algorithms). The step's verbs
are in training/rl/verbs.py, the order they run in (rl.schedule) in training/rl/schedules.py; this
file builds the run and ends each step the same way whatever the schedule."""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from dare_core.config import DareConfig
from dare_core.devices import resolve_dtype
from dare_core.models.hf_folder import load_model
from dare_core.sampling.engines import build_engine
from dare_core.training import engine as eng
from dare_core.training.plots import STAGE_PLOTS
from dare_core.training.reference import frozen_reference, sync_reference
from dare_core.training.rl.checks import check_rl, rl_start_folder
from dare_core.training.rl.ranks import reduce_step_metrics
from dare_core.training.rl.schedules import SCHEDULES, ahead_files, load_ahead
from dare_core.training.rl.validation import due
from dare_core.training.rl.verbs import RLRun, Rollout, Update, ratio_is_trivial
from dare_core.training.setup import prepare_for_training
from dare_core.training.stage import CheckpointFacts, TrainingStage

log = logging.getLogger(__name__)


def _val_postfix(val_metrics: dict) -> dict:
    """The progress bar's view of the last validation: its maj@k."""
    return {key.split("/")[1]: f"{v:.3f}" for key, v in val_metrics.items() if key.startswith("val/maj@")}


def run_rl(cfg: DareConfig, progress: bool = True, save_checkpoints: bool = True, phase_times: Optional[bool] = None) -> dict:
    """The RL stage. `save_checkpoints` off: no training checkpoints (benchmarks); `phase_times`:
    log where each step's time goes (None: `DARE_PHASE_TIMES` decides; `dare_core.timing`)."""
    return RLStage(cfg, progress, save_checkpoints, export=False, phase_times=phase_times).run()


class RLStage(TrainingStage):
    """RL in the steps of training/stage.py: from the SFT model; no export (`convert` reads the last
    checkpoint). Its steps run in the order of rl.schedule (training/rl/schedules.py)."""

    name, title, active_timer, steps_key, exports_model = "rl", "RL", True, "num_steps", False

    def check(self) -> CheckpointFacts:
        self.plan = check_rl(self.cfg)
        return self.plan.checkpoints

    def load(self, device: torch.device) -> torch.nn.Module:
        return prepare_for_training(load_model(rl_start_folder(self.cfg), dtype=resolve_dtype(self.cfg.model.dtype), device=device),
                                    self.cfg)

    def adopt(self, model: torch.nn.Module) -> None:
        rl = self.cfg.rl
        self.ref = frozen_reference(model, self.cfg.model.lora, needed=rl.kl_beta > 0)
        self.algo = self.plan.algo

    def build_engine(self, model: torch.nn.Module):
        rl = self.cfg.rl
        rollouts = rl.prompts_per_step * self.algo.rows_per_prompt
        mini = rollouts // rl.mini_batches
        local_mini = mini // eng.planned_data_ranks(self.cfg.launch)
        self.micro = min(rl.micro_batch_size, local_mini)
        updates = rl.num_steps * rl.num_iterations * rl.mini_batches
        engine = eng.build_engine(model, rl.optim, updates, self.micro, -(-local_mini // self.micro), self.cfg.launch)
        # an external engine starts from the folder the policy was loaded from
        self.rollout_engine = build_engine(rl.sampler.engine, engine.module,
                                           **{"model_path": str(rl_start_folder(self.cfg)), **rl.sampler.engine_args})
        return engine

    def frozen_models(self) -> list:
        return [self.ref] if self.ref is not None else []

    def plots(self) -> tuple[tuple, dict]:
        return ("reward", "accuracy"), STAGE_PLOTS["rl"]

    def resume(self) -> list[Rollout]:
        """What a resumed run restores beyond the engine: the reference of its last sync, and (a
        schedule that collects ahead) the rollouts its checkpoint kept for the next steps."""
        rl, engine, ref, start = self.cfg.rl, self.engine, self.ref, self.start
        if ref is not None and rl.ref_sync_steps and rl.ref_sync_steps <= start < rl.num_steps:
            # the reference of a resumed run is the policy of its last sync: exact when the checkpoint is
            # a sync step (the checkpoints do not keep the reference)
            sync_reference(ref, engine.module, engine.zero_optimization_stage() >= 3)
            if start % rl.ref_sync_steps:
                log.warning("rl.ref_sync_steps = %d: resuming at step %d, between two syncs; the reference is the resumed "
                            "policy instead of that of step %d (save_every a multiple of ref_sync_steps makes resumes exact)",
                            rl.ref_sync_steps, start, start - start % rl.ref_sync_steps)
        return load_ahead(self.ckpt.resumed, self.rank, engine.device, rl, start)

    def rl_run(self) -> RLRun:
        """What every verb reads (training/rl/verbs.py), once the engine is built."""
        cfg = self.cfg
        return RLRun(rl=cfg.rl, seed=cfg.run.seed, launch=cfg.launch, algo=self.algo, engine=self.engine,
                     rollout_engine=self.rollout_engine, tokenizer=self.plan.tokenizer, rows=self.plan.rows, ref=self.ref,
                     micro=self.micro, timer=self.timer, rank=self.data_rank, world=self.data_units)

    def train(self) -> dict:
        cfg, rl, timer, engine, logger, rank = self.cfg, self.cfg.rl, self.timer, self.engine, self.logger, self.rank
        validator, tokenizer = self.plan.validator, self.plan.tokenizer
        ahead = self.resume()
        validator.open(self.start, writer=rank == 0)
        if ratio_is_trivial(rl):
            log.warning("num_iterations = 1 with one mini-batch: the ratio is exactly 1 and clipping is inactive")
        run = self.rl_run()

        def validate(step: int) -> dict:
            """Validation due after `step` updates ({} when none is), on the whole weights."""
            with eng.rollout_weights(engine, cfg.launch, needed=due(step, rl)):
                return validator(run.rollout_engine, tokenizer, step)

        bar = self.progress_bar(rl.num_steps, f"rl[{rl.algorithm}]")
        t_start = time.time()
        val_postfix: dict = {}
        if self.start == 0:  # the SFT model, before any update (a resumed run validated it already)
            val_metrics = validate(0)
            if val_metrics:
                logger.log(0, val_metrics)
                val_postfix = _val_postfix(val_metrics)

        def end_step(step: int, rollout: Rollout, update: Update, t0: float, ahead: list[Rollout]) -> None:
            """Metrics, validation, logging and the checkpoint after step `step`, whatever the schedule."""
            nonlocal val_postfix
            metrics = rollout.metrics
            metrics.update(step_time_s=time.time() - t0, rollout_time_s=rollout.seconds, lr=engine.get_lr()[0])
            # every rank's share of the step in one set of metrics (the same on every rank)
            metrics = reduce_step_metrics({"prompts": rollout.prompts, "metrics": metrics, "updates": update.metrics,
                                           "loss": update.loss}, rl.num_iterations * rl.mini_batches)
            # before the checkpoint: a run resumed from it must not validate this step again
            val_metrics = validate(step + 1)
            metrics.update(val_metrics)
            val_postfix = _val_postfix(val_metrics) or val_postfix
            if (step + 1) % rl.log_every == 0 or step + 1 == rl.num_steps or val_metrics:
                # phase times: the slowest rank's
                logger.log(step + 1, {**metrics, **reduce_step_metrics({"prompts": rollout.prompts, "metrics": timer.step_metrics()})})
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.2f}", **val_postfix)
            if self.save_checkpoints:
                # rollouts collected ahead are part of the run's state: a resumed run trains on them
                self.ckpt.after_step(engine, step + 1, engine.module.hf_config, rank_files=ahead_files(rank, ahead) or None)

        try:
            SCHEDULES.lookup(rl.schedule)(run, bar, end_step, ahead)
        finally:
            run.rollout_engine.close()  # an external engine's process ends with the stage
        bar.close()
        summary = {"steps": rl.num_steps, "algorithm": rl.algorithm, "wall_s": round(time.time() - t_start, 1)}
        if validator.history:  # the last validation, beside the run's other headline numbers
            summary["validation"] = validator.history[-1]
        return summary
