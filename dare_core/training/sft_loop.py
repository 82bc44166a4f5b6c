"""The SFT loop: deterministic data order, DeepSpeed steps, atomic resumable checkpoints, metrics,
and the final Hugging Face export."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from dare_core.algorithms.registry import SFT_OBJECTIVE_OF_NOISE, build_options, get_sft_objective
from dare_core.config import DareConfig
from dare_core.data.batching import balanced_micro_batches, global_batch_indices, row_tokens, sft_batch
from dare_core.data.schema import DataError, read_rows, table_row
from dare_core.diffusion.seeding import sample_generators
from dare_core.inputs import tokenizer_folder
from dare_core.models.hf_folder import save_model
from dare_core.models.lm import DiffusionLM
from dare_core.ownership import leave_stage_off_note
from dare_core.training import engine as eng
from dare_core.training.metrics import end_without_rows, last_logged
from dare_core.training.parallel import check_sequence_parallel
from dare_core.training.plots import sft_plots
from dare_core.training.setup import initial_model, initial_spec, stage_tokenizer
from dare_core.training.stage import CheckpointFacts, TrainingStage

if TYPE_CHECKING:
    from dare_core.algorithms.base import Algorithm

log = logging.getLogger(__name__)


def encode_sft_rows(rows: list[dict], tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    return [tokenizer.encode(r["prompt_text"]) for r in rows], [tokenizer.encode(r["response"]) for r in rows]


def sft_row_cost(prompts: list, responses: list, pad_to: int, eos_padding: bool):
    """Row index -> the positions it attends in training (what micro-batches are balanced on)."""
    return lambda i: row_tokens(len(prompts[i]), len(responses[i]), pad_to, eos_padding)


@dataclass
class SFTPlan:
    """What `check_sft` read and decided: everything the run needs, before anything is written."""

    rows: list
    tokenizer: object
    prompts: list
    responses: list
    algo: object
    checkpoints: CheckpointFacts


def check_sft_settings(cfg: DareConfig, spec: DiffusionLM) -> Algorithm:
    """The checks of the SFT settings against the model (`spec`, weightless): no data read. Returns
    the loss objective."""
    check_sequence_parallel(cfg.launch, spec)
    if spec.family.noise == "uniform":
        algo_cls = get_sft_objective(SFT_OBJECTIVE_OF_NOISE["uniform"])
        return algo_cls(build_options(algo_cls, {}, "sft"))
    algo_cls = get_sft_objective(SFT_OBJECTIVE_OF_NOISE["masked"])
    return algo_cls(build_options(algo_cls, {"loss_norm": cfg.sft.loss_norm, "mask_law": cfg.sft.mask_law,
                                             "edit_noise": cfg.sft.edit_noise}, "sft"), spec.mask_token_id, spec.config.vocab_size)


def check_sft(cfg: DareConfig) -> SFTPlan:
    """The SFT stage's own checks, before it writes anything or starts DeepSpeed: the data, the
    tokenizer, the model (its config only), prompt lengths, the loss options (the checkpoints and
    outputs: the `plan` step of training/stage.py)."""
    scfg = cfg.sft
    data_path = Path(cfg.data.prepared_dir) / "sft.parquet"
    rows = read_rows(data_path, "sft")
    if not rows:
        raise DataError(f"{data_path}: no rows to train on")
    tokenizer = stage_tokenizer(cfg)
    prompts, responses = encode_sft_rows(rows, tokenizer)
    spec = initial_spec(cfg, tokenizer)
    algo = check_sft_settings(cfg, spec)
    too_long = [i for i, p in enumerate(prompts) if len(p) + scfg.pad_to > spec.max_sequence_length]
    if too_long:
        i = too_long[0]
        raise DataError(f"{table_row(data_path, i)}: prompt of {len(prompts[i])} tokens + sft.pad_to {scfg.pad_to} "
                        f"exceeds the model maximum {spec.max_sequence_length}")
    # trained from scratch, the initial model is written too (the base model folder)
    checkpoints = CheckpointFacts(spec, {"data file": data_path}, model_folders=() if cfg.model.path else (cfg.base_model_dir,))
    return SFTPlan(rows, tokenizer, prompts, responses, algo, checkpoints)


def run_sft(cfg: DareConfig, progress: bool = True, save_checkpoints: bool = True, export: bool = True,
            phase_times: Optional[bool] = None) -> dict:
    """The SFT stage. `save_checkpoints` / `export` off: no training checkpoints / no final export
    (benchmarks); `phase_times`: log where each step's time goes (None: `DARE_PHASE_TIMES` decides;
    `dare_core.timing`)."""
    return SFTStage(cfg, progress, save_checkpoints, export, phase_times).run()


class SFTStage(TrainingStage):
    """SFT in the steps of training/stage.py: from the init (or model.path), exported to sft/model."""

    name, title, export_stats = "sft", "SFT", True

    def check(self) -> CheckpointFacts:
        self.plan = check_sft(self.cfg)
        return self.plan.checkpoints

    def load(self, device: torch.device) -> torch.nn.Module:
        return initial_model(self.cfg, self.plan.tokenizer, device)

    def adopt(self, model: torch.nn.Module) -> None:
        self.model = model
        if eng.planned_rank() == 0 and not self.cfg.model.path:
            save_model(model, self.cfg.base_model_dir, extra_files={"tokenizer": tokenizer_folder(self.cfg)})

    def build_engine(self, model: torch.nn.Module):
        scfg = self.cfg.sft
        return eng.build_engine(model, scfg.optim, scfg.max_steps, scfg.micro_batch_size, scfg.grad_accum, self.cfg.launch)

    def plots(self) -> tuple[tuple, dict]:
        return ("loss",), sft_plots(self.cfg.sft.loss_norm)

    def train(self) -> dict:
        cfg, scfg, timer, engine, model, logger = self.cfg, self.cfg.sft, self.timer, self.engine, self.model, self.logger
        rows, prompts, responses, algo = self.plan.rows, self.plan.prompts, self.plan.responses, self.plan.algo
        # the ranks of a sequence-parallel group train on the same micro-batches (training/parallel.py)
        units, unit, rank, start, out_dir = self.data_units, self.data_rank, self.rank, self.start, self.out_dir
        global_batch = scfg.micro_batch_size * scfg.grad_accum * units
        row_cost = sft_row_cost(prompts, responses, scfg.pad_to, model.block_size is None)
        engine.train()
        bar = self.progress_bar(scfg.max_steps, "sft")
        t0 = time.time()
        loss = None
        for step in bar:
            timer.step_begin()
            idx = global_batch_indices(step, global_batch, len(rows), cfg.run.seed)
            mine = balanced_micro_batches(idx, row_cost, scfg.micro_batch_size)[unit::units]
            batches = [sft_batch([prompts[i] for i in m], [responses[i] for i in m], [rows[i]["uid"] for i in m], scfg.pad_to, model.eos_token_id, model.pad_token_id, eos_padding=model.block_size is None) for m in mine]
            denom = eng.all_reduce_sum(algo.global_denominator([b.response_mask for b in batches]))
            loss_sum = 0.0
            for b in batches:
                b = _to(b, engine.device)
                gens = sample_generators((cfg.run.seed, "sft", step), b.uids)
                with timer.phase("forward_backward"):
                    out = algo.loss(engine.module, b, gens, denom)
                    eng.backward_global(engine, out.loss)
                with timer.phase("optimizer"):
                    engine.step()
                loss_sum += out.loss.item()
            loss = eng.all_reduce_sum(loss_sum)
            if (step + 1) % scfg.log_every == 0 or step + 1 == scfg.max_steps:
                lr = engine.get_lr()[0]
                logger.log(step + 1, {"loss": loss, "lr": lr, "samples_per_s": (step + 1 - start) * global_batch / (time.time() - t0),
                                      **timer.step_metrics()})
                bar.set_postfix(loss=f"{loss:.3f}")
            if self.save_checkpoints:
                self.ckpt.after_step(engine, step + 1, model.hf_config)
        bar.close()

        if loss is None:  # resumed at the last step: nothing trained, the logged loss stands
            loss = last_logged(out_dir, "loss")
        if scfg.max_steps == 0 and rank == 0:
            # no SFT: the stage's outputs exist (DVC expects them) and the model is exported unchanged
            leave_stage_off_note(out_dir / "checkpoints", "sft.max_steps is 0: nothing trained, no checkpoint")
            end_without_rows(out_dir / "metrics.jsonl")
        return {"final_loss": loss, "steps": scfg.max_steps, "global_batch": global_batch, "wall_s": round(time.time() - t0, 1)}


def _to(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    batch.input_ids, batch.attention_mask, batch.response_mask = batch.input_ids.to(device), batch.attention_mask.to(device), batch.response_mask.to(device)
    return batch
