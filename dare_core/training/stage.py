"""The one skeleton of a training stage (SFT, preference, RL): named steps that `TrainingStage.run`
takes in order, each stage filling them in (the shape of a torchtune recipe's setup / train /
save / cleanup):

    check   every check, before anything is written or DeepSpeed starts -> the CheckpointManager
    load    the start model onto the device                     (timed as "load")
    adopt   what is built from the model before the engine wraps it (reference copy, objective)
    engine  the DeepSpeed engine                                (timed as "engine")
    begin   the step to start from (a resumed checkpoint's), then the metrics log
    train   the steps, from `self.start`, -> the summary
    finish  the export (where the stage has one) and the summary in metrics/<stage>.json
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ClassVar, Mapping, Optional

import torch
from tqdm.auto import tqdm

from dare_core import devices
from dare_core.config import DareConfig
from dare_core.data.lengths import resolve as resolve_lengths
from dare_core.inputs import tokenizer_folder
from dare_core.models.hf_folder import save_model
from dare_core.storage import atomic_write_json
from dare_core.timing import PhaseTimer, phase_times_requested
from dare_core.training import engine as eng
from dare_core.training.checkpoint import CheckpointManager
from dare_core.training.metrics import MetricsLogger
from dare_core.training.parallel import layout


class TrainingStage:
    """One run of a training stage. A stage sets `name` (its config section, folder and
    metrics/<name>.json) and `title` (how its log lines name it), and fills in `check`, `load`,
    `adopt`, `build_engine`, `plots` and `train`; `steps` is the step the run ends at."""

    name: ClassVar[str]
    title: ClassVar[str]
    # the export also logs the writer's own counters (time/export_*) beside its phase times
    export_stats: ClassVar[bool] = False
    # the timer charges phases timed deep inside the step (rollouts, rewards) only while it is the
    # active one: RL's
    active_timer: ClassVar[bool] = False

    def __init__(self, cfg: DareConfig, progress: bool = True, save_checkpoints: bool = True, export: bool = True,
                 phase_times: Optional[bool] = None):
        self.cfg = resolve_lengths(cfg)  # `auto` lengths, as the prepare stage derived them
        self.progress, self.save_checkpoints, self.export = progress, save_checkpoints, export
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
    def check(self) -> CheckpointManager:
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
                self.ckpt = self.check()
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
