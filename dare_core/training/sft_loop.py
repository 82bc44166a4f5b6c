"""The SFT loop: deterministic data order, DeepSpeed steps, atomic resumable checkpoints, metrics,
and the final Hugging Face export."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dare_core.algorithms.registry import build_options, get_algorithm
from dare_core.config import DareConfig
from dare_core.data.batching import global_batch_indices, sft_batch
from dare_core.data.schema import DataError, read_rows
from dare_core.diffusion.seeding import sample_generators
from dare_core.models.registry import save_model
from dare_core.storage import atomic_write_json
from dare_core.training import engine as eng
from dare_core.training.checkpoint import CheckpointManager, stage_fingerprint
from dare_core.training.engine import resolve_dtype
from dare_core.training.metrics import MetricsLogger, last_logged
from dare_core.training.preflight import check_outputs, checkpoint_bytes, model_bytes, stage_writes
from dare_core.training.setup import initial_model, initial_spec, sampler_dict, stage_tokenizer, tokenizer_folder

log = logging.getLogger(__name__)


def encode_sft_rows(rows: list[dict], tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    return [tokenizer.encode(r["prompt_text"]) for r in rows], [tokenizer.encode(r["response"]) for r in rows]


@dataclass
class SFTPlan:
    """What `check_sft` read and decided: everything the run needs, before anything is written."""

    rows: list
    tokenizer: object
    prompts: list
    responses: list
    algo: object
    ckpt: CheckpointManager


def check_sft(cfg: DareConfig) -> SFTPlan:
    """Every check of the SFT stage, before it writes anything or starts DeepSpeed: the data, the
    tokenizer, the model (its config only), prompt lengths, the loss options, the checkpoints
    (made with these settings, unless --restart), writable outputs and room on the disk."""
    scfg = cfg.sft
    out_dir = cfg.stage_dir("sft")
    data_path = Path(cfg.data.prepared_dir) / "sft.parquet"
    rows = read_rows(data_path, "sft")
    if not rows:
        raise DataError(f"{data_path}: no rows to train on")
    tokenizer = stage_tokenizer(cfg)
    prompts, responses = encode_sft_rows(rows, tokenizer)
    spec = initial_spec(cfg, tokenizer)
    too_long = [i for i, p in enumerate(prompts) if len(p) + scfg.pad_to > spec.max_sequence_length]
    if too_long:
        i = too_long[0]
        raise DataError(f"{data_path}: row {i}: prompt of {len(prompts[i])} tokens + sft.pad_to {scfg.pad_to} exceeds the model maximum {spec.max_sequence_length}")
    algo_cls = get_algorithm("sft")
    algo = algo_cls(build_options(algo_cls, {"loss_norm": scfg.loss_norm, "mask_law": scfg.mask_law}, "sft"), spec.mask_token_id)

    dtype = resolve_dtype(cfg.model.dtype)
    ckpt_bytes = checkpoint_bytes(spec, dtype)
    ckpt = CheckpointManager(out_dir / "checkpoints", scfg.keep_last, stage_fingerprint(cfg, "sft", {"data file": data_path}),
                             "sft", cfg.restart, ckpt_bytes)
    ckpt.check()
    writes = stage_writes(out_dir) + [out_dir / "model", Path(cfg.run.metrics_dir) / "sft.json"]
    if not cfg.model.path:
        writes.append(cfg.base_model_dir)
    export = model_bytes(spec, dtype) * (1 if cfg.model.path else 2)  # sft/model (and base)
    check_outputs(writes, [(out_dir / "checkpoints", ckpt_bytes), (out_dir / "model", export)],
                  "an SFT checkpoint and the exported model")
    return SFTPlan(rows, tokenizer, prompts, responses, algo, ckpt)


def run_sft(cfg: DareConfig, progress: bool = True) -> dict:
    scfg = cfg.sft
    out_dir = cfg.stage_dir("sft")
    plan = check_sft(cfg)
    rows, tokenizer, prompts, responses, algo, ckpt = plan.rows, plan.tokenizer, plan.prompts, plan.responses, plan.algo, plan.ckpt

    # every check has passed: from here on the stage may write
    model = initial_model(cfg, tokenizer, eng.device())
    if eng.planned_rank() == 0 and not cfg.model.path:
        save_model(model, cfg.base_model_dir, extra_files={"tokenizer": tokenizer_folder(cfg)})
    engine = eng.build_engine(model, scfg.optim, scfg.max_steps, scfg.micro_batch_size, scfg.grad_accum, cfg.launch.zero_stage)
    world, rank = eng.world_size(), eng.rank()
    global_batch = scfg.micro_batch_size * scfg.grad_accum * world
    start = ckpt.begin(engine, "SFT")
    logger = MetricsLogger(out_dir, resume_step=start, plot_keys=("loss",), enabled=rank == 0)

    engine.train()
    bar = tqdm(range(start, scfg.max_steps), initial=start, total=scfg.max_steps, desc="sft", disable=not progress or rank != 0, dynamic_ncols=True)
    t0 = time.time()
    loss = None
    for step in bar:
        idx = global_batch_indices(step, global_batch, len(rows), cfg.run.seed)
        micro = [idx[o:o + scfg.micro_batch_size] for o in range(0, global_batch, scfg.micro_batch_size)]
        mine = micro[rank::world]
        batches = [sft_batch([prompts[i] for i in m], [responses[i] for i in m], [rows[i]["uid"] for i in m], scfg.pad_to, model.eos_token_id, model.pad_token_id, eos_padding=model.block_size is None) for m in mine]
        denom = eng.all_reduce_sum(algo.global_denominator([b.response_mask for b in batches]))
        loss_sum = 0.0
        for b in batches:
            b = _to(b, engine.device)
            gens = sample_generators((cfg.run.seed, "sft", step), b.uids)
            out = algo.loss(engine.module, b, gens, denom)
            engine.backward(out.loss, scale_wrt_gas=False)
            engine.step()
            loss_sum += out.loss.item()
        loss = eng.all_reduce_sum(loss_sum)
        if (step + 1) % scfg.log_every == 0 or step + 1 == scfg.max_steps:
            lr = engine.get_lr()[0]
            logger.log(step + 1, {"loss": loss, "lr": lr, "samples_per_s": (step + 1 - start) * global_batch / (time.time() - t0)})
            bar.set_postfix(loss=f"{loss:.3f}")
        if (step + 1) % scfg.save_every == 0 or step + 1 == scfg.max_steps:
            ckpt.save(engine, step + 1, {"step": step + 1}, model.hf_config)
    bar.close()
    logger.close()

    if loss is None:  # resumed at the last step: nothing trained, the logged loss stands
        loss = last_logged(out_dir, "loss")
    summary = {"final_loss": loss, "steps": scfg.max_steps, "global_batch": global_batch, "wall_s": round(time.time() - t0, 1)}
    if rank == 0:
        save_model(engine.module, out_dir / "model", extra_files={"tokenizer": tokenizer_folder(cfg)}, sampler=sampler_dict(cfg))
        atomic_write_json(Path(cfg.run.metrics_dir) / "sft.json", summary)
    return summary


def _to(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    batch.input_ids, batch.attention_mask, batch.response_mask = batch.input_ids.to(device), batch.attention_mask.to(device), batch.response_mask.to(device)
    return batch
