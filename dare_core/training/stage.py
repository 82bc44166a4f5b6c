"""The one skeleton of a training stage (SFT, preference, RL): named steps that `TrainingStage.run`
takes in order, each stage filling them in but `plan`, the skeleton's own (the shape of a torchtune
recipe's setup / train / save / cleanup):

    check   the stage's own checks (data, tokenizer, model config, objective), before anything is
            written or DeepSpeed starts -> what its checkpoints depend on (`CheckpointFacts`)
    plan    the checkpoint half of the checks, the same for every stage: the fingerprint, the
            checkpoint to resume, writable outputs and room on the disk -> the CheckpointManager
            (timed with `check` as "checks")
    load    the start model onto the device                     (timed as "load")
    adopt   what is built from the loaded model before the engine wraps it (a reference copy);
            the objective `check` built against the weightless model is kept, not built again
    engine  the DeepSpeed engine                                (timed as "engine")
    begin   the step to start from (a resumed checkpoint's), then the metrics log
    train   the steps, from `self.start`, -> the summary
    finish  the export (where the stage has one) and the summary in metrics/<stage>.json
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Mapping, Optional

import torch
from tqdm.auto import tqdm

from dare_core import devices
from dare_core.artifacts import artifact_root
from dare_core.config import DareConfig
from dare_core.data.lengths import resolve as resolve_lengths
from dare_core.inputs import tokenizer_folder
from dare_core.models.hf_folder import save_model
from dare_core.storage import atomic_write_json
from dare_core.timing import PhaseTimer, phase_times_requested
from dare_core.training import engine as eng
from dare_core.training.checkpoint import CheckpointManager, SavePolicy
from dare_core.training.fingerprint import stage_fingerprint
from dare_core.training.metrics import MetricsLogger
from dare_core.training.parallel import layout
from dare_core.training.preflight import check_outputs, checkpoint_bytes, model_bytes, stage_writes, training_need


@dataclass(frozen=True)
class CheckpointFacts:
    """What a stage's checks tell the `plan` step its checkpoints depend on, beyond its config
    section: `spec`, the model it trains (weightless), sizes them; `inputs` (role -> file or
    folder) are fingerprinted with the settings, less the section's `unrecorded` keys (those that
    change no trained weight); `model_folders` are the model folders it writes besides its export
    (each of the spec's weights); `protect` names the checkpoints pruning keeps beyond the last
    keep_last (CheckpointManager)."""

    spec: torch.nn.Module
    inputs: Mapping[str, Path]
    unrecorded: tuple[str, ...] = ()
    model_folders: tuple[Path, ...] = ()
    protect: Optional[Callable[[list[str]], set[str]]] = None


class TrainingStage:
    """One run of a training stage. A stage sets `name` (its config section, folder and
    metrics/<name>.json), `title` (how its log lines name it), `steps_key` (its section's step
    count, which the checkpoints' save policy reads too) and `exports_model`, and fills in `check`,
    `load`, `adopt`, `build_engine`, `plots` and `train`; `steps` is the step the run ends at."""

    name: ClassVar[str]
    title: ClassVar[str]
    steps_key: ClassVar[str] = "max_steps"
    # the stage ends in a model folder, <stage>/model (unless `export` is off); RL's end is its
    # last checkpoint, which `convert` reads
    exports_model: ClassVar[bool] = True
    # the export also logs the writer's own counters (time/export_*) beside its phase times
    export_stats: ClassVar[bool] = False
    # the timer charges phases timed deep inside the step (rollouts, rewards) only while it is the
    # active one: RL's
    active_timer: ClassVar[bool] = False

    def __init__(self, cfg: DareConfig, progress: bool = True, save_checkpoints: bool = True, export: bool = True,
                 phase_times: Optional[bool] = None):
        self.cfg = resolve_lengths(cfg)  # `auto` lengths, as the prepare stage derived them
        self.progress, self.save_checkpoints, self.export = progress, save_checkpoints, export and self.exports_model
        self.timer = PhaseTimer(phase_times_requested(phase_times))
        self.out_dir = self.cfg.stage_dir(self.name)
        self.ckpt: Optional[CheckpointManager] = None
        self.engine = None
        self._bars: list = []  # the progress bars made, closed before an error is reported
        self.world, self.rank, self.start, self.steps = 1, 0, 0, 0
        # the data-parallel units (the ranks, or their sequence-parallel groups: training/parallel.py)
        # and this rank's: what the data is split by
        self.data_units, self.data_rank = 1, 0
        self.logger: Optional[MetricsLogger] = None

    # ------------------------------------------------------------------ the steps a stage fills in
    def check(self) -> CheckpointFacts:
        """The stage's own checks; keeps what the later steps read (`self.plan`)."""
        raise NotImplementedError

    def load(self, device: torch.device) -> torch.nn.Module:
        raise NotImplementedError

    def adopt(self, model: torch.nn.Module) -> None:
        """What is built from the loaded model before the engine wraps it (nothing by default)."""

    def build_engine(self, model: torch.nn.Module):
        raise NotImplementedError

    def frozen_models(self) -> list:
        """The models scored beside the engine's (a frozen reference copy): sequence-parallel too."""
        return []

    def plots(self) -> tuple[tuple, Mapping]:
        """(the keys written to <key>.csv, the PNGs drawn) of the metrics log."""
        raise NotImplementedError

    def train(self) -> dict:
        raise NotImplementedError

    def finish(self, summary: dict) -> dict:
        """The export and metrics/<name>.json. ZeRO-3 partitions the parameters across the ranks:
        every rank takes part in gathering them for rank 0's export (a collective; nothing to
        gather under ZeRO 0-2)."""
        with eng.whole_weights(self.engine, self.export):
            if self.rank == 0:
                if self.export:
                    self.export_model()
                atomic_write_json(Path(self.cfg.run.metrics_dir) / f"{self.name}.json", summary)
        return summary

    # ------------------------------------------------------------------ the skeleton
    def run(self) -> dict:
        with self.timer.active() if self.active_timer else contextlib.nullcontext():
            with self.timer.phase("checks"):
                self.ckpt = self.plan_checkpoints(self.check())
            # every check has passed: from here on the stage may write
            with self.timer.phase("load"):
                model = self.load(devices.device())
            self.adopt(model)
            with self.timer.phase("engine"):
                self.engine = self.build_engine(model)
            self.world, self.rank = eng.world_size(), eng.rank()
            self.data_units, self.data_rank = eng.data_units(), eng.data_rank()
            for module in (self.engine.module, *self.frozen_models()):
                module.sequence_shards = layout().shards
            self.start = self.ckpt.begin(self.engine, self.title)
            plot_keys, pngs = self.plots()
            self.logger = MetricsLogger(self.out_dir, resume_step=self.start, plot_keys=plot_keys, enabled=self.rank == 0,
                                        pngs=pngs, rank_of_several=self.world > 1)
            try:
                summary = self.finish(self.train())
            except BaseException:
                # the bar's line ends first: the error's line then starts a line of its own
                for bar in self._bars:
                    bar.close()
                raise
            self.logger.close()
            return summary

    def plan_checkpoints(self, facts: CheckpointFacts) -> CheckpointManager:
        """The `plan` step: the checkpoints of these settings and inputs (the one to resume checked,
        unless --restart), then writable outputs and room on the disk for what the run writes (the
        checkpoints its save policy writes, where they are saved, the export and `facts.model_folders`)."""
        cfg, out_dir, section = self.cfg, self.out_dir, getattr(self.cfg, self.name)
        self.steps = getattr(section, self.steps_key)
        dtype = devices.resolve_dtype(cfg.model.dtype)
        weights = model_bytes(facts.spec, dtype)
        fingerprint = stage_fingerprint(cfg, self.name, dict(facts.inputs), facts.unrecorded)
        ckpt = CheckpointManager(out_dir / "checkpoints", section.keep_last, fingerprint, self.name, cfg.restart,
                                 checkpoint_bytes(facts.spec, dtype), mirror=artifact_root(cfg),
                                 policy=SavePolicy(section.save_every, self.steps, exports=self.export),
                                 weights_bytes=weights, protect=facts.protect)
        ckpt.check()
        saves, existing = ckpt.planned_writes() if self.save_checkpoints else ([], [])
        models = ([out_dir / "model"] if self.export else []) + list(facts.model_folders)
        needs = [(out_dir, training_need(saves, existing, section.keep_last, weights if self.export else 0))]
        needs += [(folder, weights) for folder in facts.model_folders]
        what = f"the {self.title} checkpoints" + (" and the exported model" if self.exports_model else "")
        check_outputs(stage_writes(out_dir) + [Path(cfg.run.metrics_dir) / f"{self.name}.json"] + models, needs, what, models)
        return ckpt

    # ------------------------------------------------------------------ shared parts
    def progress_bar(self, total: int, desc: str) -> tqdm:
        """The steps from `start` to `total`, a progress bar on rank 0 (when asked for)."""
        bar = tqdm(range(self.start, total), initial=self.start, total=total, desc=desc,
                   disable=not self.progress or self.rank != 0, dynamic_ncols=True)
        self._bars.append(bar)
        return bar

    def export_model(self) -> None:
        """Rank 0: the engine's weights as a Hugging Face folder in <stage>/model, with the
        tokenizer and the sampler settings; its phase times (and, `export_stats`, the writer's own
        counters) logged at the last step when phase times are on."""
        export_metrics: dict = {}
        export_stats: dict = {}
        with self.timer.export(export_metrics):
            save_model(self.engine.module, self.out_dir / "model", extra_files={"tokenizer": tokenizer_folder(self.cfg)},
                       sampler=self.cfg.eval.sampler.decoding_settings(), stats=export_stats if self.export_stats else None)
        if export_metrics:
            export_metrics.update({f"time/export_{k}": v for k, v in export_stats.items()})
            self.logger.log(self.steps, export_metrics)
