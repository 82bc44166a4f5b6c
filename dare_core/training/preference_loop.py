"""The preference loop (docs/algorithms.md#preference-optimisation): ELBO-DPO / VRPO from the SFT model on
`preference.parquet`, with deterministic data order, DeepSpeed steps, atomic resumable checkpoints,
metrics, and the final Hugging Face export (`runs/<name>/preference/model`).

One step: the global batch of pairs is split into micro-batches of whole pairs; for each, the masks
are drawn from (run_seed, step, pair uid), the reference ELBOs are computed once on the stored masks
(before any update of the step), then the policy recomputes its ELBOs on the same masks, and the
loss, divided by the global number of pairs, is backpropagated row chunk by row chunk.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dare_core.algorithms.preference import ElboDPO, build_preference, get_preference
from dare_core.config import DareConfig
from dare_core.data.batching import balanced_micro_batches, global_batch_indices, pair_batch, row_tokens
from dare_core.data.lengths import resolve as resolve_lengths
from dare_core.data.pairs import why_no_pairs
from dare_core.data.schema import DataError, read_rows, table_row
from dare_core.devices import resolve_dtype
from dare_core.models.hf_folder import inspect_model, load_model
from dare_core.models.lm import DiffusionLM
from dare_core.training import engine as eng
from dare_core.training.metrics import last_logged
from dare_core.training.parallel import check_sequence_parallel
from dare_core.training.plots import STAGE_PLOTS
from dare_core.training.preference_off import off_reason, write_off_stage
from dare_core.training.reference import frozen_reference, reference_model
from dare_core.training.setup import prepare_for_training, stage_tokenizer
from dare_core.training.stage import CheckpointFacts, TrainingStage

log = logging.getLogger(__name__)

PLOT_KEYS = ("loss", "reward_margin", "reward_accuracy")


def preference_start_folder(cfg: DareConfig) -> Path:
    """Preference optimisation starts from the SFT stage's exported model (a side branch: RL
    starts from the same folder)."""
    return cfg.stage_dir("sft") / "model"


def encode_pairs(rows: list[dict], tokenizer) -> tuple[list, list, list]:
    return ([tokenizer.encode(r["prompt_text"]) for r in rows], [tokenizer.encode(r["chosen"]) for r in rows],
            [tokenizer.encode(r["rejected"]) for r in rows])


def check_pairs(path: Path, prompts: list, chosen: list, rejected: list, pad_to: int, max_len: int) -> None:
    """Prompt + canvas must fit the model, and each response + one EOS the canvas (never truncated)."""
    for i, (p, w, lo) in enumerate(zip(prompts, chosen, rejected)):
        where = table_row(path, i)
        if len(p) + pad_to > max_len:
            raise ValueError(f"{where}: prompt of {len(p)} tokens + preference.pad_to {pad_to} exceeds the model maximum {max_len}")
        for column, r in (("chosen", w), ("rejected", lo)):
            if len(r) + 1 > pad_to:
                raise ValueError(f"{where}: column '{column}' is {len(r)} tokens + 1 EOS > preference.pad_to {pad_to}")


def check_preference_config(cfg: DareConfig) -> None:
    """Configuration errors before any data or model is read."""
    get_preference(cfg.preference.algorithm)
    lora = cfg.model.lora or {}
    if float(lora.get("dropout", 0.0)) > 0:
        # the proxy-gradient replay needs the value pass and the replay pass to be identical
        raise ValueError("preference needs model.lora.dropout: 0 (its proxy-gradient replay recomputes the ELBO rows exactly)")


def check_preference_settings(cfg: DareConfig, spec: DiffusionLM) -> ElboDPO:
    """The checks of the preference settings against the model (`spec`, weightless): no data read.
    Returns the objective (it keeps the model's token ids only: the loaded model's are the same)."""
    check_preference_config(cfg)
    objective = build_preference(cfg.preference, spec)  # its options
    check_sequence_parallel(cfg.launch, spec)
    return objective


@dataclass
class PreferencePlan:
    """What `check_preference` read and decided, before anything is written."""

    rows: list
    prompts: list
    chosen: list
    rejected: list
    objective: ElboDPO
    checkpoints: CheckpointFacts


def check_preference(cfg: DareConfig) -> PreferencePlan:
    """The preference stage's own checks, before it writes anything or starts DeepSpeed: config,
    pairs, the SFT model (its config only), lengths, the objective's options (the checkpoints and
    outputs: the `plan` step of training/stage.py)."""
    pcfg = cfg.preference
    check_preference_config(cfg)
    data_path = Path(cfg.data.prepared_dir) / "preference.parquet"
    rows = read_rows(data_path, "preference")
    if not rows:  # run_preference turns the stage off first (preference_off.py); a direct caller gets this
        raise DataError(f"{data_path}: no preference pairs: {why_no_pairs(cfg)}")
    start_folder = preference_start_folder(cfg)
    if not (start_folder / "config.json").is_file():
        raise FileNotFoundError(f"{start_folder}: no SFT model to start from (run the sft stage first)")
    tokenizer = stage_tokenizer(cfg)
    prompts, chosen, rejected = encode_pairs(rows, tokenizer)
    spec = prepare_for_training(inspect_model(start_folder), cfg)
    check_pairs(data_path, prompts, chosen, rejected, pcfg.pad_to, spec.max_sequence_length)
    objective = check_preference_settings(cfg, spec)
    return PreferencePlan(rows, prompts, chosen, rejected, objective,
                          CheckpointFacts(spec, {"data file": data_path, "start model": start_folder}))


def run_preference(cfg: DareConfig, progress: bool = True, save_checkpoints: bool = True, export: bool = True,
                   phase_times: Optional[bool] = None) -> dict:
    """The preference stage. `save_checkpoints` / `export` off: no training checkpoints / no final
    export (benchmarks); `phase_times`: log where each step's time goes (None: `DARE_PHASE_TIMES`
    decides; `dare_core.timing`)."""
    cfg = resolve_lengths(cfg)  # `auto` lengths, as the prepare stage derived them
    check_preference_config(cfg)  # a wrong setting is an error even while the stage is off
    reason = off_reason(cfg)
    if reason:
        return write_off_stage(cfg, reason, writer=eng.rank() == 0)
    return PreferenceStage(cfg, progress, save_checkpoints, export, phase_times).run()


class PreferenceStage(TrainingStage):
    """Preference optimisation in the steps of training/stage.py: from the SFT model, exported to
    preference/model."""

    name, title = "preference", "preference"

    def check(self) -> CheckpointFacts:
        self.plan = check_preference(self.cfg)
        return self.plan.checkpoints

    def load(self, device: torch.device) -> torch.nn.Module:
        return prepare_for_training(load_model(preference_start_folder(self.cfg), dtype=resolve_dtype(self.cfg.model.dtype),
                                               device=device), self.cfg)

    def adopt(self, model: torch.nn.Module) -> None:
        self.policy = model
        # the reference: a frozen copy, or with LoRA the policy with its adapter disabled (no copy)
        self.frozen = frozen_reference(model, self.cfg.model.lora)
        self.objective = self.plan.objective

    def build_engine(self, model: torch.nn.Module):
        pcfg = self.cfg.preference
        return eng.build_engine(model, pcfg.optim, pcfg.max_steps, pcfg.micro_batch_size, pcfg.grad_accum, self.cfg.launch)

    def frozen_models(self) -> list:
        return [self.frozen] if self.frozen is not None else []

    def plots(self) -> tuple[tuple, dict]:
        return PLOT_KEYS, STAGE_PLOTS["preference"]

    def train(self) -> dict:
        cfg, pcfg, timer, engine, logger = self.cfg, self.cfg.preference, self.timer, self.engine, self.logger
        rows, prompts, chosen, rejected = self.plan.rows, self.plan.prompts, self.plan.chosen, self.plan.rejected
        policy, frozen, objective = self.policy, self.frozen, self.objective
        # the ranks of a sequence-parallel group train on the same micro-batches (training/parallel.py)
        units, unit, start, out_dir = self.data_units, self.data_rank, self.start, self.out_dir
        global_pairs = pcfg.micro_batch_size * pcfg.grad_accum * units

        def backward(loss: torch.Tensor) -> None:  # a share of a sum over the global number of pairs
            eng.backward_global(engine, loss)

        eos_padding = policy.block_size is None
        pair_cost = lambda i: sum(row_tokens(len(prompts[i]), len(r[i]), pcfg.pad_to, eos_padding) for r in (chosen, rejected))  # noqa: E731
        engine.train()
        bar = self.progress_bar(pcfg.max_steps, f"preference[{pcfg.algorithm}]")
        t0 = time.time()
        metrics: dict = {}
        for step in bar:
            timer.step_begin()
            idx = global_batch_indices(step, global_pairs, len(rows), cfg.run.seed)
            batches, corruptions = [], []
            for m in balanced_micro_batches(idx, pair_cost, pcfg.micro_batch_size)[unit::units]:
                b = _to(pair_batch([prompts[i] for i in m], [chosen[i] for i in m], [rejected[i] for i in m],
                                   [rows[i]["uid"] for i in m], pcfg.pad_to, policy.eos_token_id, policy.pad_token_id,
                                   eos_padding=policy.block_size is None), engine.device)
                batches.append(b)
                corruptions.append(objective.corrupt(b, (cfg.run.seed, step)))
            # reference ELBOs once per batch, on the stored masks, before this step's updates
            with timer.phase("scoring"), reference_model(engine.module, frozen) as ref:
                ref_elbos = [objective.reference_elbos(ref, b, c) for b, c in zip(batches, corruptions)]
            sums = torch.zeros(4, dtype=torch.float64)
            for b, c, r in zip(batches, corruptions, ref_elbos):
                with timer.phase("forward_backward"):
                    out = objective.update(engine.module, b, c, r, global_pairs, backward)
                with timer.phase("optimizer"):
                    engine.step()
                sums += torch.tensor([float(out.loss), out.metrics["reward_margin"], out.metrics["reward_accuracy"], out.metrics["pairs"]],
                                     dtype=torch.float64)
            sums = eng.all_reduce_sum(sums)
            loss, margin, correct, n = (float(v) for v in sums)
            metrics = {"loss": loss, "reward_margin": margin / max(n, 1.0), "reward_accuracy": correct / max(n, 1.0)}
            if not math.isfinite(loss):
                raise FloatingPointError(f"preference step {step + 1}: the loss is {loss}")
            if (step + 1) % pcfg.log_every == 0 or step + 1 == pcfg.max_steps:
                logger.log(step + 1, {**metrics, "lr": engine.get_lr()[0],
                                      "pairs_per_s": (step + 1 - start) * global_pairs / max(time.time() - t0, 1e-9),
                                      **timer.step_metrics()})
                bar.set_postfix(loss=f"{loss:.3f}", acc=f"{metrics['reward_accuracy']:.2f}")
            if self.save_checkpoints:
                self.ckpt.after_step(engine, step + 1, engine.module.hf_config)
        bar.close()

        return {
            "enabled": True,
            "algorithm": pcfg.algorithm,
            "shared_masks": objective.shared_masks,
            "stratified": objective.stratified,
            "steps": pcfg.max_steps,
            "global_pairs": global_pairs,
            "final_loss": metrics.get("loss", last_logged(out_dir, "loss")),
            "reward_margin": metrics.get("reward_margin", last_logged(out_dir, "reward_margin")),
            "reward_accuracy": metrics.get("reward_accuracy", last_logged(out_dir, "reward_accuracy")),
            "wall_s": round(time.time() - t0, 1),
        }


def _to(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    batch.input_ids, batch.attention_mask, batch.response_mask = batch.input_ids.to(device), batch.attention_mask.to(device), batch.response_mask.to(device)
    return batch
