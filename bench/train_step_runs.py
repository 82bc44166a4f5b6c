"""bench/train_step.py's runs: each task (a model folder, an SFT run, an RL run) runs the stage loop
itself in a child process of its own, with params.yaml and the run's overrides as a stage reads
them; the parent turns each task's metrics into a results row."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from rl_pieces import REWARD, register_rl_pieces, token_hash_reward
from model_throughput import peak_bf16
from stamp import REPO, hardware, host_memory_bytes, jsonl_rows, mean
from train_step_setup import (FAMILIES, Settings, evict_page_cache, optimizer_host_bytes, shape_config, write_data,
                              write_model_folder)

ENTRY = Path(__file__).with_name("train_step.py")  # a child runs `train_step.py --task SPEC`
RL_PHASES = ("rollout", "reward", "scoring", "forward_backward", "optimizer")
STARTUP_PHASES = ("checks", "load", "engine")
EXPORT_PHASES = ("produce", "copy", "disk_wait", "other")  # merging the adapter in, copying off the GPU, waiting for the disk, opening and closing files

# --------------------------------------------------------------------------- one run (child process)


def stage_config(spec: dict):
    """params.yaml with the run's overrides, read as a stage reads it."""
    from dare_core.config import load_config

    overrides = [f"{key}={json.dumps(value)}" for key, value in spec["overrides"].items()]
    return load_config(REPO / "params.yaml", overrides)


def common_overrides(spec: dict) -> dict:
    root = Path(spec["workdir"])
    name = spec["name"]
    return {
        "run.name": name, "run.seed": 0, "run.runs_dir": str(root / "runs"), "run.models_dir": str(root / "models"),
        "run.metrics_dir": str(root / "runs" / name / "metrics"), "data.prepared_dir": spec["data"],
        "data.tokenizer_dir": spec["folder"], "model.path": spec["folder"], "model.family": FAMILIES[spec["shape"]],
        "model.gradient_checkpointing": True, "model.dtype": "auto",
    }


def sft_overrides(spec: dict, s: Settings) -> dict:
    lora = {"r": s.sft_lora[0], "alpha": s.sft_lora[1]} if spec["training"] == "lora" else None
    return {
        **common_overrides(spec), "model.packing": spec["packing"], "model.compile": spec.get("compile", False), "model.lora": lora,
        # full parameters: ZeRO-3 with the optimizer on the CPU (DeepSpeedCPUAdam): the fp32 master
        # weights, gradients and Adam moments of a full 8B model (16 bytes a parameter) do not fit one GPU
        "launch.zero_stage": 0 if lora else 3, "launch.offload_optimizer": "none" if lora else "cpu",
        "sft.max_steps": s.sft_warmup + s.sft_steps, "sft.micro_batch_size": s.sft_micro, "sft.grad_accum": s.sft_accum,
        "sft.pad_to": s.sft_pad_to, "sft.log_every": 1, "sft.save_every": 10**9,
        "sft.optim": {"lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
    }


# the rl-engines runs: what lmdeploy's engine honours exactly and ours does the same way (the untempered
# confidence of the sampled token at temperature 1, one position committed per step)
ENGINE_SAMPLER = {"temperature": 1.0, "remasking": "low_confidence", "unmasking": "topk"}
ENGINE_PHASES = RL_PHASES + ("weight_sync",)


def rl_overrides(spec: dict, s: Settings, block_size: Optional[int]) -> dict:
    cuda = torch.cuda.is_available()
    sampler = {
        "gen_length": s.rl_gen, "steps": s.rl_denoise_steps, "block_length": block_size or s.rl_block,
        "temperature": s.rl_temperature, "cache": "block_kv" if block_size else "dual",
        "cuda_graphs": True if cuda else None, "compile_forward": cuda, "engine": "native", "batch_size": s.rollout_batch,
        "lora_merged": cuda and s.rl_lora_merged,
    }
    if spec.get("engine"):  # an rl-engines run: both engines decode the same way
        sampler.update(ENGINE_SAMPLER, steps=s.rl_gen, engine=spec["engine"],
                       engine_args={"cache_max_entry_count": 0.3, "log_dir": spec["workdir"]} if spec["engine"] != "native" else {})
    return {
        **common_overrides(spec), "model.packing": "on", "model.compile": spec.get("compile", False),
        "model.lora": {"r": s.rl_lora[0], "alpha": s.rl_lora[1]}, "launch.zero_stage": 0, "model.logits_chunk": s.rl_logits_chunk,
        "rl.algorithm": "d1", "rl.algorithm_args": {"d1": {"p_mask_prompt": 0.15}}, "rl.reward": REWARD,
        "rl.num_steps": s.rl_steps, "rl.prompts_per_step": s.rl_prompts,
        "rl.group_size": s.rl_group, "rl.num_iterations": s.rl_iterations, "rl.mini_batches": 1,
        "rl.micro_batch_size": s.rl_micro, "rl.adv_estimator": "grpo", "rl.kl_beta": s.rl_kl, "rl.sampler": sampler,
        "rl.optim": {"lr": 1e-6}, "rl.validate_every": 0, "rl.log_every": 1, "rl.save_every": 10**9,
    }


def metrics_rows(out_dir: Path) -> list[dict]:
    """The stage's metrics.jsonl rows so far."""
    return jsonl_rows(out_dir / "metrics.jsonl")


def run_rl_on_folder(cfg, folder: str, stage: Optional[Callable[..., object]] = None) -> dict:
    """The RL stage loop (phase times on, no checkpoints) started from `folder` in place of the SFT
    stage's export, with the bench's synthetic reward registered. `stage`: an RLStage subclass (or a
    partial of one) to run instead, phase times off (bench/profile_step.py's, which profiles parts
    of a step in place of running steps)."""
    from dare_core.training.rl.checks import rl_start_folder
    from dare_core.training.rl.loop import run_rl

    register_rl_pieces()
    link_start_folder(cfg, folder)
    if stage is not None:
        return stage(cfg, progress=False, save_checkpoints=False, export=False, phase_times=False).run()
    return run_rl(cfg, progress=False, save_checkpoints=False, phase_times=True)


def link_start_folder(cfg, folder: str) -> None:
    """The RL stage's start folder as a link to `folder`; left alone when it already is one (the
    ranks of one run all call this, after their parent made it)."""
    from dare_core.training.rl.checks import rl_start_folder

    start = rl_start_folder(cfg)
    if start.is_symlink() and start.resolve() == Path(folder).resolve():
        return
    start.parent.mkdir(parents=True, exist_ok=True)
    if start.is_symlink():  # (an earlier run's)
        start.unlink()
    start.symlink_to(folder, target_is_directory=True)


def sft_step_work(cfg, world: int = 1) -> list[dict]:
    """Per step: real and padded tokens, and the model FLOPs of the useful work (bench/model_throughput.py's
    model) of all `world` ranks together, rebuilt with the loop's own batching from the same data order."""
    from model_throughput import model_flops

    from dare_core.data.batching import balanced_micro_batches, global_batch_indices, sft_batch
    from dare_core.data.schema import read_rows
    from dare_core.models.hf_folder import inspect_model
    from dare_core.training.setup import stage_tokenizer
    from dare_core.training.sft_loop import encode_sft_rows, sft_row_cost

    rows = read_rows(Path(cfg.data.prepared_dir) / "sft.parquet", "sft")
    prompts, responses = encode_sft_rows(rows, stage_tokenizer(cfg))
    model = inspect_model(cfg.model.path)
    sc = cfg.sft
    global_batch = sc.micro_batch_size * sc.grad_accum * world
    cost = sft_row_cost(prompts, responses, sc.pad_to, model.block_size is None)
    work = []
    for step in range(sc.max_steps):
        idx = global_batch_indices(step, global_batch, len(rows), cfg.run.seed)
        padded, lens, rank_tokens = 0, [], [0] * world
        for k, m in enumerate(balanced_micro_batches(idx, cost, sc.micro_batch_size)):
            b = sft_batch([prompts[i] for i in m], [responses[i] for i in m], [rows[i]["uid"] for i in m], sc.pad_to,
                          model.eos_token_id, model.pad_token_id, eos_padding=model.block_size is None)
            lens += b.attention_mask.sum(-1).tolist()
            padded += b.attention_mask.numel()
            rank_tokens[k % world] += int(b.attention_mask.sum())  # the loop's micro[rank::world]
        # block diffusion trains through the two-stream layout [x_t ; x_0]: its forward runs every
        # real token twice
        flops = model_flops(model, [2 * n for n in lens] if model.block_size else lens, backward=True)
        work.append({"real_tokens": sum(lens), "padded_tokens": padded, "sequences": len(lens), "flops": flops,
                     "rank_tokens": rank_tokens})
    return work


def run_sft_task(spec: dict, s: Settings) -> dict:
    from dare_core.training.sft_loop import run_sft

    cfg = stage_config({**spec, "overrides": sft_overrides(spec, s)})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    launch = time.time() - spec["spawned_at"]
    summary = run_sft(cfg, progress=False, save_checkpoints=False, export=spec["export"], phase_times=True)
    out = {"summary": summary, "metrics": metrics_rows(cfg.stage_dir("sft")), "work": sft_step_work(cfg), "launch_s": launch}
    shutil.rmtree(cfg.stage_dir("sft") / "model", ignore_errors=True)  # 16 GB of the disk
    return out


def rl_stage_config(spec: dict, s: Settings):
    """An RL run's config (params.yaml with `rl_overrides` at the folder's block size), its run
    folder emptied."""
    from dare_core.models.hf_folder import inspect_model

    block_size = inspect_model(spec["folder"]).block_size
    cfg = stage_config({**spec, "overrides": rl_overrides(spec, s, block_size)})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return cfg


def run_rl_task(spec: dict, s: Settings) -> dict:
    cfg = rl_stage_config(spec, s)
    launch = time.time() - spec["spawned_at"]
    summary = run_rl_on_folder(cfg, spec["folder"])
    metrics = metrics_rows(cfg.stage_dir("rl"))
    work = [rl_pass_flops(cfg, spec["folder"], m) for m in metrics if "sequence_tokens" in m]
    return {"summary": summary, "metrics": metrics, "launch_s": launch, "work": work, "lora_merged": cfg.rl.sampler.lora_merged,
            "rollouts": cfg.rl.prompts_per_step * cfg.rl.group_size}


def rl_pass_flops(cfg, folder: str, step: dict) -> dict:
    """Model FLOPs of one RL step's scoring and update passes (bench/model_throughput.py's count; the
    two-stream layout of block diffusion counts each token twice), from the step's mean sequence
    length: every rollout taken as that long, which undercounts attention by the lengths' spread.
    The passes are the loop's: an old-policy forward per inner iteration but the first where the
    first iteration's weights rolled out (training/rl/verbs.py first_iteration_is_current), none where the ratio is
    trivially 1; a reference forward per iteration with a KL term; a forward and backward per iteration."""
    from model_throughput import model_flops

    from dare_core.models.hf_folder import inspect_model
    from dare_core.training.rl.verbs import first_iteration_is_current, ratio_is_trivial

    rl = cfg.rl
    model = inspect_model(folder)
    n = step["sequence_tokens"] * (2 if model.block_size else 1)
    lens = [n] * (rl.prompts_per_step * rl.group_size)
    old = 0 if ratio_is_trivial(rl) else rl.num_iterations - (1 if first_iteration_is_current(rl) else 0)
    ref = rl.num_iterations if rl.kl_beta > 0 else 0
    return {"step": step["step"], "scoring_flops": (old + ref) * model_flops(model, lens, backward=False),
            "update_flops": rl.num_iterations * model_flops(model, lens, backward=True),
            "rollout_flops": rollout_flops(model, step)}


def rollout_flops(model, step: dict) -> Optional[float]:
    """Model FLOPs of the forwards the step's rollouts ran, from what the sampler says they encoded
    (`GenerationOutput.work`): 2 x the body's parameters per encoded token (every refresh of the
    whole canvas included: the GPU does that work), 2 x the LM head's per column whose logits were
    taken, and QK^T + AV per (query, key) pair attended. The adapter's own FLOPs are not counted
    (merged rollouts do not run them)."""
    if "rollout_encoded_tokens" not in step:
        return None
    c = model.config
    head = c.d_model * c.vocab_size  # (tied to the embeddings or not)
    body = sum(p.numel() for n, p in model.net.named_parameters() if "embed" not in n and not n.startswith("lm_head"))
    attn = 4 * c.n_layers * c.n_heads * c.head_dim * step["rollout_key_pairs"]
    return 2 * body * step["rollout_encoded_tokens"] + 2 * head * step["rollout_logit_tokens"] + attn


def run_d1_task(spec: dict, s: Settings) -> dict:
    """d1's own step code (bench/peer_d1.py) on the shape's folder with the DARE run's prompts, LoRA,
    rollouts and inner iterations, at d1's own batch settings (`public_chunk` prompts a generate
    call and a per-device batch): `rl_public_steps` steps, each timed by phase."""
    import peer_d1
    from dare_core.data.schema import read_rows
    from dare_core.devices import resolve_dtype
    from dare_core.models.hf_folder import load_model
    from dare_core.models.lora import LoraSettings, adapter_disabled, apply_lora
    from dare_core.models.tokenizer import load_tokenizer

    path = peer_d1.PEERS / "d1" / peer_d1.D1_FILE
    if not path.exists():
        return {"error": f"d1's code is not on this machine: its trainer file {peer_d1.D1_FILE} is looked for in a checkout "
                         f"of dllm-reasoning/d1 at bench/.peers/d1"}
    t0 = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(spec["folder"], dtype=resolve_dtype("auto"), device=device)
    apply_lora(model, LoraSettings(r=s.rl_lora[0], alpha=s.rl_lora[1]))
    tok = load_tokenizer(spec["folder"])
    rows = read_rows(Path(spec["data"]) / "rl.parquet", "rl")[:s.rl_prompts]
    d1 = peer_d1.D1Settings(gen_length=s.rl_gen, block_length=s.rl_block, diffusion_steps=s.rl_denoise_steps,
                            temperature=s.rl_temperature, generation_batch_size=s.public_chunk, per_device_batch=s.public_chunk,
                            num_iterations=s.rl_iterations, beta=s.rl_kl, lr=1e-6)
    trainer = peer_d1.D1Trainer(peer_d1.load_methods(path), d1, model.mask_token_id)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=d1.lr)

    def reward(completions: torch.Tensor) -> torch.Tensor:
        return torch.tensor([token_hash_reward(tok.decode(ids), "0").score for ids in completions.tolist()])

    prompts = [tok.encode(r["prompt_text"]) for r in rows]
    metrics = []
    launch = time.time() - spec["spawned_at"]
    for step in range(s.rl_public_steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out = peer_d1.d1_step(trainer, model, optimizer, prompts, s.rl_group, d1, model.eos_token_id, model.pad_token_id,
                              reward, lambda: adapter_disabled(model))
        metrics.append({"step": step + 1, "time/step_s": out["step_s"], "reward": out["reward"], "zero_std_ratio": out["zero_std_ratio"],
                        **{f"time/{p}_s": out.get(f"{p}_s", 0.0) for p in RL_PHASES},
                        "memory/peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None})
    return {"metrics": metrics, "launch_s": launch, "setup_s": time.time() - t0 - sum(m["time/step_s"] for m in metrics),
            "d1_commit": peer_d1.source_commit(path)}


def run_task(spec: dict) -> dict:
    s = Settings(**spec["settings"])
    if spec["kind"] == "folder":
        return write_model_folder(spec["shape"], Path(spec["folder"]), spec["tiny"])
    if spec["kind"] == "sft":
        return run_sft_task(spec, s)
    if spec["kind"] == "rl-d1":
        return run_d1_task(spec, s)
    return run_rl_task(spec, s)


def task_main(spec_path: Path, run: Callable[[dict], dict] = run_task) -> int:
    """A child: run one task (`run`: another bench's tasks, which hand this one's kinds to
    `run_task`), write its result (or its error) next to the spec."""
    spec = json.loads(spec_path.read_text())
    result_path = spec_path.with_suffix(".result.json")
    try:
        result = run(spec)
        result.update(hardware=hardware(), peak_flops=peak_bf16())
    except Exception as exc:  # recorded in the results file: a bench reports what failed, and goes on
        traceback.print_exc()
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            result = {"error": f"out of GPU memory ({str(exc).splitlines()[0][:160]})"}
        else:
            result = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result_path.write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- the parent: plan and run


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # the interpreter's own tools first (ninja for DeepSpeed's JIT ops), as the stage commands run
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def torchrun(ranks: int) -> list[str]:
    """The command prefix that starts `ranks` processes of one host (one a GPU), as `dare stage` does."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]


def rank_env(ranks: int) -> dict:
    """`child_env` with the CPU thread counts `dare stage` gives each of `ranks` ranks (torchrun alone
    would give each OMP_NUM_THREADS=1, and an offloaded optimizer steps on the CPU)."""
    from dare_core.config import LaunchConfig
    from dare_core.process.threads import launcher_env

    return launcher_env(LaunchConfig().threads, ranks, child_env())


class Runner:
    """Runs tasks in child processes (`entry --task SPEC`: train_step.py, or another bench built on
    its tasks), logs each to the work folder, returns their results."""

    def __init__(self, workdir: Path, timeout: Optional[float], verbose: bool, replay: Optional[Path] = None,
                 entry: Path = ENTRY):
        self.dir = workdir / "tasks"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timeout, self.verbose, self.replay, self.entry = timeout or None, verbose, replay, entry

    def __call__(self, name: str, spec: dict, gpu: Optional[int] = None) -> dict:
        """`gpu`: the one GPU the child sees (CUDA_VISIBLE_DEVICES); None: the parent's view. With
        `replay`, nothing runs: the result a finished run's task wrote there is read back."""
        if self.replay is not None:
            done = self.replay / f"{name}.result.json"
            return json.loads(done.read_text()) if done.exists() else {"error": f"no result of {name} in {self.replay}"}
        spec_path = self.dir / f"{name}.json"
        result_path = spec_path.with_suffix(".result.json")
        log_path = spec_path.with_suffix(".log")
        result_path.unlink(missing_ok=True)
        spec_path.write_text(json.dumps({**spec, "spawned_at": time.time()}))
        print(f"[{self.entry.stem}] {name} ...", flush=True)
        t0 = time.perf_counter()
        with log_path.open("w") as log:
            try:
                env = child_env() if gpu is None else {**child_env(), "CUDA_VISIBLE_DEVICES": str(gpu)}
                proc = subprocess.run([sys.executable, str(self.entry), "--task", str(spec_path)], env=env, cwd=REPO,
                                      stdout=None if self.verbose else log, stderr=subprocess.STDOUT, timeout=self.timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
        wall = time.perf_counter() - t0
        if result_path.exists():
            result = json.loads(result_path.read_text())
        elif code is None:
            result = {"error": f"stopped after the {self.timeout:.0f} s task limit"}
        elif code < 0:
            result = {"error": f"killed by signal {-code}" + (" (host out of memory?)" if -code == 9 else "")}
        else:
            result = {"error": f"exited with code {code}, no result (see {log_path})"}
        result["wall_s"] = wall
        status = result.get("error", "ok")
        print(f"[{self.entry.stem}] {name}: {status} ({wall:.0f} s)", flush=True)
        if "error" in result and not self.verbose:
            print("".join(log_path.read_text().splitlines(keepends=True)[-25:]), flush=True)
        return result


def sft_row(shape: str, training: str, packing: str, result: dict, s: Settings, compiled: bool = False) -> dict:
    row = {"part": "sft" if training == "lora" else "sft-full", "shape": shape, "training": training, "packing": packing,
           "compile": compiled, "hardware": result.get("hardware")}
    if "error" in result:
        return {**row, "error": result["error"]}
    steps = [m for m in result["metrics"] if "time/step_s" in m]
    timed = steps[s.sft_warmup:]
    work = result["work"][s.sft_warmup:]
    seconds = sum(m["time/step_s"] for m in timed)
    row.update(
        steps=len(timed), sequences=mean([w["sequences"] for w in work]),
        real_tokens=mean([w["real_tokens"] for w in work]), padded_tokens=mean([w["padded_tokens"] for w in work]),
        step_s=seconds / len(timed), fwd_bwd_s=mean([m.get("time/forward_backward_s") for m in timed]),
        optimizer_s=mean([m.get("time/optimizer_s") for m in timed]),
        tokens_per_s=sum(w["real_tokens"] for w in work) / seconds,
        mfu=sum(w["flops"] for w in work) / seconds / result["peak_flops"] if result["peak_flops"] else None,
        peak_gib=max((m["memory/peak_gib"] for m in timed if "memory/peak_gib" in m), default=None),
        **startup(steps, result),
        export_s=next((m["time/export_s"] for m in result["metrics"] if "time/export_s" in m), None),
        export_parts=next(({k: m.get(f"time/export_{k}_s") for k in EXPORT_PHASES} for m in result["metrics"] if "time/export_s" in m), {}),
        loss=steps[-1].get("loss") if steps else None,
    )
    return row


def startup(steps: list[dict], result: dict) -> dict:
    """Start-up seconds and their phases, from the first logged step."""
    first = steps[0] if steps else {}
    return {"startup_s": first.get("time/startup_s"), "launch_s": result.get("launch_s"),
            "startup_parts": {p: first.get(f"time/startup_{p}_s") for p in STARTUP_PHASES}}


def rl_row(shape: str, recipe: str, result: dict, compiled: bool = False) -> dict:
    row = {"part": "rl" if recipe == "dare" else "rl-d1", "shape": shape, "recipe": recipe, "hardware": result.get("hardware"),
           "d1_commit": result.get("d1_commit"), "compile": compiled, "lora_merged": result.get("lora_merged", False),
           "rollouts": result.get("rollouts")}
    if "error" in result:
        return {**row, "error": result["error"]}
    steps = [m for m in result["metrics"] if "time/step_s" in m]
    last = steps[-1]
    row.update({p: last.get(f"time/{p}_s", 0.0) for p in RL_PHASES})
    row.update(step=last["step"], step_s=last["time/step_s"], **startup(steps, result),
               zero_std_ratio=last.get("zero_std_ratio"), reward_std=last.get("reward_std"),
               peak_gib=last.get("memory/peak_gib"), response_tokens=last.get("response_tokens"))
    row["other"] = row["step_s"] - sum(row[p] for p in RL_PHASES)
    work = next((w for w in result.get("work", []) if w["step"] == last["step"]), None)
    passes = row["scoring"] + row["forward_backward"]
    if work and result.get("peak_flops") and passes > 0:  # the training pass: scoring and forward+backward
        row["train_mfu"] = (work["scoring_flops"] + work["update_flops"]) / passes / result["peak_flops"]
    if work and work.get("rollout_flops") and result.get("peak_flops") and row["rollout"] > 0:
        row["rollout_peak"] = work["rollout_flops"] / row["rollout"] / result["peak_flops"]
    return row


def rl_engine_row(shape: str, engine: str, result: dict) -> dict:
    """An rl-engines row: the same step with `engine`'s rollouts, the weight push included."""
    row = {"part": "rl-engines", "shape": shape, "recipe": engine, "hardware": result.get("hardware")}
    if "error" in result:
        return {**row, "error": result["error"]}
    steps = [m for m in result["metrics"] if "time/step_s" in m]
    last = steps[-1]
    row.update({p: last.get(f"time/{p}_s", 0.0) for p in ENGINE_PHASES})
    # (`reward` is the reward phase's seconds, as in the rl rows; the step's mean reward is apart)
    row.update(step=last["step"], step_s=last["time/step_s"], peak_gib=last.get("memory/peak_gib"),
               zero_std_ratio=last.get("zero_std_ratio"), mean_reward=last.get("reward"))
    row["other"] = row["step_s"] - sum(row[p] for p in ENGINE_PHASES)
    return row


def engine_rows(shape: str, folder: Path, args, run) -> list[dict]:
    """The rl-engines pair: the step with native rollouts and with lmdeploy's, side by side on two
    GPUs where asked; a shape lmdeploy does not decode says so."""
    from dare_core.models.family import get_family

    if get_family(shape_config(shape, args.tiny)["model_type"]).block_size is None:
        return [{"part": "rl-engines", "shape": shape, "recipe": e, "error": "not run: lmdeploy decodes block-diffusion "
                 "models (SDAR) only"} for e in ("native", "lmdeploy")]
    if args.side_by_side:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            done = {e: pool.submit(run, f"rl-{e}", gpu, kind="rl", recipe="dare", engine=e)
                    for gpu, e in enumerate(("native", "lmdeploy"))}
            return [{**rl_engine_row(shape, e, f.result()), "side_by_side": True} for e, f in done.items()]
    return [rl_engine_row(shape, e, run(f"rl-{e}", kind="rl", recipe="dare", engine=e)) for e in ("native", "lmdeploy")]


class Rows(list):
    """The rows measured so far; each one added rewrites the results file, so a run stopped by a
    time limit still leaves what it measured (its file says which runs it has)."""

    def __init__(self, save: Callable[[list[dict]], None]):
        super().__init__()
        self.save = save

    def append(self, row: dict) -> None:
        super().append(row)
        self.save(list(self))

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self


def prepare_shape(shape: str, workdir: Path, tiny: bool, s: Settings, runner: Runner) -> tuple[dict, Optional[dict]]:
    """The spec every run at `shape` starts from: its model folder in the work folder (written first,
    by a task, if the work folder lacks it) and the data; and that task's result (None: the folder
    was there; with "error": it could not be written)."""
    base = workdir / ("tiny" if tiny else "8b") / shape
    folder, data = base / "model", base / "data"
    written = None
    if not (folder / "config.json").exists():
        written = runner(f"{shape}-folder", {"kind": "folder", "shape": shape, "folder": str(folder), "tiny": tiny,
                                             "settings": dataclasses.asdict(s)})
    data.mkdir(parents=True, exist_ok=True)
    write_data(data, s)
    spec = {"shape": shape, "folder": str(folder), "data": str(data), "workdir": str(base), "tiny": tiny,
            "settings": dataclasses.asdict(s)}
    return spec, written


def run_shape(shape: str, parts: list[str], args, s: Settings, runner: Runner, rows: list[dict]) -> list[dict]:
    """Every selected run at one shape, on its folder (written first if this work folder lacks it)."""
    spec, written = prepare_shape(shape, Path(args.workdir), args.tiny, s, runner)
    folder = Path(spec["folder"])
    if written is not None:
        rows.append({"part": "folder", "shape": shape, **written})
        if "error" in written:
            return rows

    def run(name: str, gpu: Optional[int] = None, **extra) -> dict:
        if args.cold:
            evict_page_cache(folder)
        return runner(f"{shape}-{name}", {**spec, "name": name, **extra}, gpu)

    if "sft" in parts:
        variants = [("on", False), ("off", False)] + ([("on", True)] if shape in args.compile_shapes else [])
        for packing, compiled in variants:
            name = f"sft-lora-{packing}" + ("-compile" if compiled else "")
            result = run(name, kind="sft", training="lora", packing=packing, compile=compiled,
                         export=packing == "on" and not compiled)
            rows.append(sft_row(shape, "lora", packing, result, s, compiled))
    if "sft-full" in parts:
        rows += full_parameter_rows(shape, folder, args, s, run)
    if "rl-engines" in parts:
        rows += engine_rows(shape, folder, args, run)
    peer = "rl-d1" in parts and shape in args.public_shapes
    if "rl" in parts and peer and args.side_by_side:
        # one run each on GPU 0 and GPU 1 at the same time: the ratio still comes from one invocation on one machine
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ours = pool.submit(run, "rl-dare", 0, kind="rl", recipe="dare")
            theirs = pool.submit(run, "rl-d1", 1, kind="rl-d1", recipe="d1")
            rows += [{**rl_row(shape, "dare", ours.result()), "side_by_side": True},
                     {**rl_row(shape, "d1", theirs.result()), "side_by_side": True}]
        return rows
    if "rl" in parts:
        rows.append(rl_row(shape, "dare", run("rl-dare", kind="rl", recipe="dare")))
        if shape in args.rl_compile_shapes:
            rows.append(rl_row(shape, "dare", run("rl-dare-compile", kind="rl", recipe="dare", compile=True), compiled=True))
    if peer:
        rows.append(rl_row(shape, "d1", run("rl-d1", kind="rl-d1", recipe="d1")))
    return rows


def full_parameter_rows(shape: str, folder: Path, args, s: Settings, run) -> list[dict]:
    """Full-parameter SFT packed and padded, or why it cannot run here."""
    from dare_core.models.hf_folder import inspect_model

    n = sum(p.numel() for p in inspect_model(folder).parameters())
    need, have = optimizer_host_bytes(n), host_memory_bytes()
    if args.full_param == "auto" and have and need > 0.9 * have:
        why = (f"not run: ZeRO-3 with the optimizer on the CPU needs about {need / 2**30:.0f} GiB of host memory "
               f"for {n / 1e9:.2f} B parameters (fp32 weights, gradients and two Adam moments, 16 bytes each), "
               f"this machine has {have / 2**30:.0f} GiB; on the GPU alone they would take {need / 2**30:.0f} GiB "
               f"beside the bf16 weights (--full-param run tries anyway)")
        return [{"part": "sft-full", "shape": shape, "training": "full", "packing": p, "error": why} for p in ("on", "off")]
    return [sft_row(shape, "full", p, run(f"sft-full-{p}", kind="sft", training="full", packing=p, export=False), s)
            for p in ("on", "off")]


