"""The DeepSpeed engine from config: one process or many (torchrun / deepspeed launcher), CPU
(gloo) or GPU (nccl), ZeRO stage, bf16 where the hardware has it, AdamW, grad clipping, LR schedule."""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from dare_core.config import LaunchConfig, OptimConfig
from dare_core.training.op_builds import announced
from dare_core.training.parallel import init_layout, layout
from dare_core.process.process_group import ensure_dist_env, init_distributed
from dare_core.process.threads import log_threads


def lr_lambda(cfg: OptimConfig, total_steps: int):
    def fn(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if cfg.schedule != "constant":
            raise ValueError(f"unknown lr schedule '{cfg.schedule}'")
        return 1.0

    return fn


def build_engine(model: torch.nn.Module, optim: OptimConfig, total_steps: int, micro_batch_size: int, grad_accum: int = 1,
                 launch: Optional[LaunchConfig] = None):
    """Wrap `model` in a DeepSpeed engine: AdamW with the LR schedule of `optim`, and `launch`'s ZeRO
    stage and what ZeRO offloads to host memory (`offload_optimizer` / `offload_params`; default:
    ZeRO-0, nothing offloaded). AdamW is a torch client optimizer (no fused-op JIT build), except with the
    optimizer offloaded: DeepSpeed steps offloaded state only with its own DeepSpeedCPUAdam (a C++
    op built on first use), so the optimizer is then given in the DeepSpeed config, the same AdamW."""
    # every training stage gets here once its checks have passed: the thread count is worth a line now
    log_threads()
    ensure_dist_env()
    import deepspeed

    with announced("ShareMemCommBuilder"):  # (loaded with the process group)
        init_distributed()
    launch = launch or LaunchConfig()
    init_layout(launch.sequence_parallel)
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = next(model.parameters()).dtype
    zero: dict = {"stage": launch.zero_stage}
    # pinned host memory: the copies to and from the GPU run asynchronously
    if launch.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": launch.offload_optimizer, "pin_memory": True}
    if launch.offload_params != "none":
        zero["offload_param"] = {"device": launch.offload_params, "pin_memory": True}
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": optim.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    adamw = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}
    schedule = lr_lambda(optim, total_steps)
    if launch.offload_optimizer == "none":
        optimizer = torch.optim.AdamW(params, **adamw)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                               lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
    else:
        # DeepSpeed builds the optimizer from its config, then the schedule around it
        ds_config["optimizer"] = {"type": "AdamW", "params": adamw}
        with announced("CPUAdamBuilder"):
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config,
                                                   lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    return engine


def planned_world_size() -> int:
    """The number of ranks, known before the process group starts (the launchers set WORLD_SIZE):
    stages check their settings against it before DeepSpeed initialises."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def planned_rank() -> int:
    """This process's rank, known before the process group starts (RANK, set by the launchers)."""
    return int(os.environ.get("RANK", "0"))


def planned_data_ranks(launch: LaunchConfig) -> int:
    """The number of data-parallel units, known before the process group starts: the ranks, or
    their sequence-parallel groups (training/parallel.py), among which the data is split."""
    return planned_world_size() // launch.sequence_parallel


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def data_units() -> int:
    """The number of data-parallel units: the ranks, or their sequence-parallel groups."""
    return layout().dp_size if layout().sp_size > 1 else world_size()


def data_rank() -> int:
    """This rank's data-parallel unit (its own index, or its sequence-parallel group's)."""
    return layout().dp_rank if layout().sp_size > 1 else rank()


def all_reduce_sum(value):
    """Global sums (e.g. loss denominators) must be known on every rank before the backward pass:
    the sum over the data-parallel units (the ranks of a sequence-parallel group hold the same
    value, counted once). A float gives a float; a tensor a float64 tensor on the CPU."""
    scalar = not isinstance(value, torch.Tensor)
    if data_units() == 1:
        return value
    t = torch.as_tensor(value, dtype=torch.float64).reshape(-1).to("cuda" if torch.cuda.is_available() else "cpu")
    torch.distributed.all_reduce(t, group=layout().dp_group)
    return t.item() if scalar else t.cpu()


def all_gather_objects(obj, every_rank: bool = False) -> list:
    """Every data-parallel unit's `obj` (picklable: small dicts of metrics), in order, on every
    rank (under sequence parallelism one per group: its ranks hold the same); `every_rank`: every
    rank's, for work split over all the ranks (validation). [obj] with one."""
    group = None if every_rank or layout().sp_size == 1 else layout().dp_group
    n = world_size() if group is None else data_units()
    if n == 1:
        return [obj]
    out: list = [None] * n
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def backward_global(engine, loss: torch.Tensor) -> None:
    """Backward of this rank's share of a loss normalised by a global denominator (`all_reduce_sum`
    over the ranks): DeepSpeed averages the ranks' gradients, so the share is scaled by the number
    of ranks for the update to follow the gradient of the sum itself (what one rank computes on
    all the rows). Gradient accumulation is not rescaled either: the denominator already covers it.
    Under sequence parallelism every rank of a group computes the group's loss, and its backward
    reaches the parameters through its own positions only (models/ulysses.py `sum_over_group`):
    the group's gradients sum to the group's, so the scale is still the number of ranks."""
    world = world_size()
    engine.backward(loss * world if world > 1 else loss, scale_wrt_gas=False)
    if engine.zero_optimization_stage() >= 3:
        # ZeRO-3 adds a backward's gradients to the earlier ones of the step only once told that a new
        # micro-batch began, which DeepSpeed's own forward (`engine(...)`) does; the loops call
        # `engine.module` (several forwards a micro-batch, some without gradients), so without this
        # each backward would replace the step's gradient: the last micro-batch (or row chunk) alone
        engine.optimizer.clear_backward_seen_flag()


def gathered(params, enabled: bool = True):
    """A context in which the ZeRO-3-partitioned `params` are whole on every rank (a collective:
    every rank must enter it); a no-op when not `enabled` (ZeRO 0-2 keep every parameter whole)."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


def whole_weights(engine, needed: bool = True):
    """A context in which `engine.module` holds its whole weights on every rank: under ZeRO-3 each
    parameter above DeepSpeed's persistence threshold is partitioned across the ranks (a rank holds
    an empty tensor and its shard), so an export must gather them first; every rank must enter it
    (the gather is a collective), each then holds the whole model until it exits. A no-op under
    ZeRO 0-2 (every rank holds every parameter) or when not `needed`."""
    return gathered(engine.module.parameters(), needed and engine.zero_optimization_stage() >= 3)


def rollout_weights(engine, launch: LaunchConfig, needed: bool = True):
    """The context RL decodes in. Under ZeRO-3 with `launch.rollout_weights: whole`, every rank
    gathers the whole weights once (a collective: every rank must enter it) and DeepSpeed's
    per-layer gather hooks are off until it exits, so decoding makes no collective calls: each
    rank stops when its own rows are done, and CUDA graphs may capture the forward. Otherwise (ZeRO
    0-2, or `partitioned`) a no-op: under ZeRO-3 the forwards then gather layer by layer and the
    ranks decode in lockstep (dare_core/sampling/lockstep.py). Not `needed`: a no-op too (nothing
    will decode: a validation that is not due)."""
    import contextlib

    if not needed or engine.zero_optimization_stage() < 3 or launch.rollout_weights != "whole":
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    return unwrap_model_for_generation(engine)
