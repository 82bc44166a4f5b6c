"""The SFT loop: deterministic data order, DeepSpeed steps, atomic resumable checkpoints, metrics,
and the final Hugging Face export."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dare_core.algorithms.registry import build_options, get_algorithm
from dare_core.config import DareConfig, to_dict
from dare_core.data.batching import global_batch_indices, sft_batch
from dare_core.data.schema import read_rows
from dare_core.diffusion.seeding import sample_generators
from dare_core.models.registry import save_model
from dare_core.storage import atomic_write_json
from dare_core.training import engine as eng
from dare_core.training.checkpoint import CheckpointManager, config_fingerprint, input_fingerprint
from dare_core.training.metrics import MetricsLogger
from dare_core.training.setup import initial_model, sampler_dict, stage_tokenizer, tokenizer_folder

log = logging.getLogger(__name__)


def encode_sft_rows(rows: list[dict], tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    return [tokenizer.encode(r["prompt_text"]) for r in rows], [tokenizer.encode(r["response"]) for r in rows]


def run_sft(cfg: DareConfig, progress: bool = True) -> dict:
    scfg = cfg.sft
    out_dir = cfg.stage_dir("sft")
    data_path = Path(cfg.data.prepared_dir) / "sft.parquet"
    rows = read_rows(data_path, "sft")
    tokenizer = stage_tokenizer(cfg)
    prompts, responses = encode_sft_rows(rows, tokenizer)

    model = initial_model(cfg, tokenizer, eng.device())
    too_long = [i for i, p in enumerate(prompts) if len(p) + scfg.pad_to > model.max_sequence_length]
    if too_long:
        i = too_long[0]
        raise ValueError(f"{data_path}: row {i}: prompt of {len(prompts[i])} tokens + pad_to {scfg.pad_to} exceeds the model maximum {model.max_sequence_length}")
    if eng.rank() == 0 and not cfg.model.path:
        save_model(model, cfg.base_model_dir, extra_files={"tokenizer": tokenizer_folder(cfg)})

    algo_cls = get_algorithm("sft")
    algo = algo_cls(build_options(algo_cls, {"loss_norm": scfg.loss_norm, "mask_law": scfg.mask_law}, "sft"), model.mask_token_id)
    engine = eng.build_engine(model, scfg.optim, scfg.max_steps, scfg.micro_batch_size, scfg.grad_accum, cfg.launch.zero_stage)
    world, rank = eng.world_size(), eng.rank()
    global_batch = scfg.micro_batch_size * scfg.grad_accum * world

    fingerprint = config_fingerprint(to_dict(cfg.model), to_dict(scfg), cfg.run.seed, world, input_fingerprint(data_path))
    ckpt = CheckpointManager(out_dir / "checkpoints", scfg.keep_last, fingerprint)
    start = ckpt.resume(engine, "SFT")
    logger = MetricsLogger(out_dir, resume_step=start, plot_keys=("loss",), enabled=rank == 0)

    engine.train()
    bar = tqdm(range(start, scfg.max_steps), initial=start, total=scfg.max_steps, desc="sft", disable=not progress or rank != 0, dynamic_ncols=True)
    t0 = time.time()
    loss = float("nan")
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
