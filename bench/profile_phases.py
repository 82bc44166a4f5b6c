"""bench/profile_step.py's child process: the RL stage of bench/train_step.py's `rl` part, built as
that run builds it (params.yaml with `rl_overrides`: the model from its folder, LoRA, the DeepSpeed
engine, d1, the native rollout engine with the dual cache or block_kv and CUDA graphs), whose `train`
profiles three parts of a step with torch.profiler in place of running steps. Step 0's rollouts come
first, through `collect` as a step draws them: they warm the sampler up (graphs captured, the forward
compiled) and are the batch the two other parts score and train on.

  denoise   one denoising step of the rollout batch, in the sampler's own loop (`generate` with the
            rollout's settings and prompts): decoding two blocks less decoding one block, over the
            block's steps. The loop offers no cut inside a block, and the first block carries what a
            rollout does once (the canvas, the prompt's prefill, the outputs), so the step is the
            mean step of the second block: with the dual cache its refresh forward counted in (one in
            a block's steps), with block_kv its commit forward.
  scoring   one micro-batch of the old policy's scores (`algo.score`, no gradients), as `score` runs it
  training  one micro-batch's forward and backward (`algo.update`, the engine's backward), as
            `optimize` runs it in an on-policy step's first inner iteration; the optimizer step apart
"""
from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from model_throughput import sync
from profile_summary import Activity, KernelTable, load_trace, summarize, trace_activities

from dare_core.batch import Batch
from dare_core.diffusion.seeding import sample_generators
from dare_core.sampling.decode import generate
from dare_core.training import engine as eng
from dare_core.training.rl.loop import RLStage
from dare_core.training.rl.verbs import RLRun, Rollout, Scores, collect, score


def wall_us(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time of `fn` over `repeats` runs, the GPU's work included, unprofiled (the
    profiler's own cost per operator would count as launch gaps)."""
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def profiled(fn: Callable[[], object], trace: Path) -> list[Activity]:
    """One run of `fn` under torch.profiler (CPU operators, and the GPU's kernels where there is
    one), its trace written to `trace` (open it in Perfetto), its work read back from it."""
    gpu = torch.cuda.is_available()
    kinds = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    sync()
    with torch.profiler.profile(activities=kinds) as prof:
        fn()
        sync()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return trace_activities(load_trace(trace), gpu)


def measured(fn: Callable[[], object], options: dict, trace: Path) -> KernelTable:
    """`fn`'s kernels (one profiled run) with its wall time (median of unprofiled runs), after
    `options["warmup"]` runs."""
    for _ in range(options["warmup"]):
        fn()
    wall = wall_us(fn, options["repeats"])
    return KernelTable.of(profiled(fn, trace), wall)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode, as the rollout engine decodes, then in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def denoise_row(run: RLRun, rollout: Rollout, options: dict, traces: Path) -> dict:
    """One denoising step of the rollout batch: two blocks' decoding less one block's, over the block's steps."""
    params, model, batch = run.rl.sampler, run.rollout_engine.model, rollout.batch
    if params.gen_length // params.block_length < 2:
        raise ValueError("the denoise profile is two blocks' decoding less one block's: gen_length must hold two blocks")
    n = min(params.batch_size, len(batch))  # one sampler batch: the rollouts that decode together
    head = slice(0, batch.prompt_len)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids[:n, head], batch.attention_mask[:n, head])]
    device = next(model.parameters()).device

    def decode(blocks: int) -> Callable[[], object]:
        def fn() -> None:
            gens = sample_generators((run.seed, "profile"), batch.uids[:n], device=device)
            with eval_mode(model):
                generate(model, prompts, params, gens, max_blocks=blocks)
        return fn

    spb = params.steps_per_block
    with eng.rollout_weights(run.engine, run.launch):
        one = measured(decode(1), options, traces / "denoise-1-block.json.gz")
        two = measured(decode(2), options, traces / "denoise-2-blocks.json.gz")
    step = two.minus(one).scaled(1 / spb)
    return {"phase": "denoise", "rollouts": n, "steps_per_block": spb, "block_length": params.block_length,
            "cache": params.cache, "cuda_graphs": bool(params.cuda_graphs), "compile_forward": params.compile_forward,
            "measured": {"1 block": one.as_dict(), "2 blocks": two.as_dict()},
            "per_step": step.as_dict(), "summary": summarize(step, options["top"]),
            "traces": [str(traces / "denoise-1-block.json.gz"), str(traces / "denoise-2-blocks.json.gz")]}


def micro_rows(run: RLRun, rollout: Rollout) -> torch.Tensor:
    """The rollout batch's first micro-batch (the rows the loop scores and trains on at once)."""
    return torch.arange(min(run.micro, len(rollout.batch)))


def scoring_row(run: RLRun, rollout: Rollout, scores: Scores, options: dict, traces: Path) -> dict:
    """One micro-batch of the old policy's scores on the first inner iteration's corruption."""
    idx, batch, corruption = micro_rows(run, rollout), rollout.batch, scores.corruptions[0]

    def fn() -> None:
        with torch.no_grad():
            run.algo.score(run.engine.module, batch.select(idx), corruption.select(idx))

    table = measured(fn, options, traces / "scoring.json.gz")
    return micro_row("scoring", table, batch.select(idx), options, traces / "scoring.json.gz")


def training_row(run: RLRun, rollout: Rollout, scores: Scores, options: dict, traces: Path) -> dict:
    """One micro-batch's update, forward and backward, with the reference's scores of its rows."""
    rl, algo, engine, batch, corruption = run.rl, run.algo, run.engine, rollout.batch, scores.corruptions[0]
    mini = torch.arange(len(batch) // rl.mini_batches)  # the first mini-batch's normaliser, as `optimize` takes it
    denom = eng.all_reduce_sum(algo.denominator(batch.select(mini), corruption.select(mini)))
    idx = micro_rows(run, rollout)
    ref = scores.ref[0][idx] if scores.ref is not None else None

    def fn() -> None:
        # old None: the first inner iteration's, whose old scores are the update's own, detached
        algo.update(engine.module, batch.select(idx), corruption.select(idx), None, ref, denom,
                    lambda loss: eng.backward_global(engine, loss))

    table = measured(fn, options, traces / "training.json.gz")
    return micro_row("training", table, batch.select(idx), options, traces / "training.json.gz")


def micro_row(phase: str, table: KernelTable, micro: Batch, options: dict, trace: Path) -> dict:
    """A micro-batch part's row: its shape, its kernel table and the summary."""
    return {"phase": phase, "sequences": len(micro), "width": micro.input_ids.shape[1], "tokens": int(micro.attention_mask.sum()),
            "per_step": table.as_dict(), "summary": summarize(table, options["top"]), "traces": [str(trace)]}


class ProfileStage(RLStage):
    """The RL stage whose `train` profiles the parts of a step named in `options["phases"]`
    (`options`: also warmup, repeats, top and the traces folder) and returns their rows."""

    def __init__(self, cfg, *args, options: dict, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.options = options

    def train(self) -> dict:
        cfg, phases, traces = self.cfg, self.options["phases"], Path(self.options["traces"])
        run = self.rl_run()
        with eng.rollout_weights(self.engine, cfg.launch):
            rollout = collect(run, 0)
            # the corruptions of the step's inner iterations and the reference's scores (the KL term's)
            scores = score(run, rollout, old=False)
        rows = []
        if "denoise" in phases:
            rows.append(denoise_row(run, rollout, self.options, traces))
        if "scoring" in phases:
            rows.append(scoring_row(run, rollout, scores, self.options, traces))
        if "training" in phases:
            rows.append(training_row(run, rollout, scores, self.options, traces))
        return {"rows": rows}
