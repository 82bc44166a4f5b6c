"""torch CPU threads on an idle and a busy machine: which thread count and OpenMP wait policy hold
up when other processes take cores, and what `launch.threads: auto` picks there.

    python3 bench/threads.py                      # writes bench/results/threads.md (~3-4 min on 2 cores)
    python3 bench/threads.py --seconds 0.5 --out /tmp/threads.md

Workloads, on the embedded default model of params.yaml (from-scratch LLaDA of `model.init`, the
arithmetic task's prompts through the chat template):
  sft      one SFT step as the stage takes it: a micro-batch of `sft.micro_batch_size` rows, the SFT
           algorithm's masked loss (`sft.mask_law`), backward, gradient clipping, AdamW
  rollout  one RL rollout batch: `rl.sampler.batch_size` prompts decoded by `generate` with
           `rl.sampler` (forward passes only)
Every (load, threads, wait policy) cell runs in a fresh interpreter, as a stage's worker starts,
each workload for `--seconds` after one warm-up step; samples/s = rows done / wall time. A step
slower than `--seconds` (a collapsed cell) is timed once, its warm-up being the measurement.

Loads: idle (whatever else runs on the machine: the load average is recorded), then cores // 2 and
cores busy-looping processes started by this bench (and killed after their cells). Thread counts:
1, 2, 4, .. and the usable cores, each with OpenMP's default wait policy (spin a while, then sleep) and
OMP_WAIT_POLICY=PASSIVE (sleep at once). `auto`: the environment `dare stage` gives its worker
(`launcher_env`, computed here under the same load as its cells), i.e. the rule being tested.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from dare_core.process.threads import REASON_VAR, launcher_env  # noqa: E402
from stamp import git_commit, hardware, header, markdown_table, usable_cores  # noqa: E402

OUT = REPO / "bench" / "results" / "threads.md"
WORKLOADS = ("sft", "rollout")
POLICIES = ("default", "PASSIVE")
# variables that would decide the thread count or wait policy of a cell instead of the bench
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", REASON_VAR)


def measure(seconds: float) -> dict:
    """Run in a fresh interpreter, as a stage's worker starts: every workload for `seconds` after a
    warm-up step, with the thread count the parent put in OMP_NUM_THREADS."""
    from dare_core.process.threads import configure_threads

    choice = configure_threads("auto")  # (the count in OMP_NUM_THREADS, taken as a worker takes it)
    import torch

    from dare_core.config import load_config
    from dare_core.models.tokenizer import char_tokenizer
    from dare_core.training.setup import initial_model

    cfg = load_config(REPO / "params.yaml")
    tokenizer = char_tokenizer()
    model = initial_model(cfg, tokenizer)
    results = {}
    for workload in WORKLOADS:
        step, rows = (sft_step if workload == "sft" else rollout_step)(cfg, tokenizer, model)
        started = time.perf_counter()
        step(0)  # warm-up: allocator, the thread pool's start
        warm_up_s = time.perf_counter() - started
        if warm_up_s > seconds:  # a collapsed cell: one more step would only double its time
            results[workload] = rows / warm_up_s
            continue
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            done += 1
            step(done)
        results[workload] = done * rows / (time.perf_counter() - started)
    return {"threads": torch.get_num_threads(), "reason": choice.reason, "samples_per_s": results,
            "wait_policy": os.environ.get("OMP_WAIT_POLICY", "default")}


def prompts_of(cfg, tokenizer, n: int) -> tuple[list[dict], list[list[int]], list[str]]:
    """`n` rows of the configured task, their prompts through the chat template, their uids."""
    from dare_core.data.synthetic import get_task

    rows = get_task(cfg.data.task).generate(n, cfg.data.seed, **cfg.data.task_args)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}])) for r in rows]
    return rows, prompts, [f"bench-{i}" for i in range(n)]


def sft_step(cfg, tokenizer, model) -> tuple[Callable[[int], None], int]:
    """One SFT micro-batch step (loss, backward, clipping, AdamW) and its row count."""
    import torch

    from dare_core.algorithms.sft import MaskedDiffusionSFT
    from dare_core.data.batching import sft_batch
    from dare_core.diffusion.seeding import sample_generators

    rows, prompts, uids = prompts_of(cfg, tokenizer, cfg.sft.micro_batch_size)
    batch = sft_batch(prompts, [tokenizer.encode(r["response"]) for r in rows], uids, cfg.sft.pad_to,
                      model.eos_token_id, model.pad_token_id)
    algo = MaskedDiffusionSFT(MaskedDiffusionSFT.Options(loss_norm=cfg.sft.loss_norm, mask_law=cfg.sft.mask_law),
                              model.mask_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft.optim.lr, weight_decay=cfg.sft.optim.weight_decay)
    denom = algo.global_denominator([batch.response_mask])

    def step(i: int) -> None:
        model.train()
        algo.loss(model, batch, sample_generators((0, "sft", i), uids), denom).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.sft.optim.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, len(rows)


def rollout_step(cfg, tokenizer, model) -> tuple[Callable[[int], None], int]:
    """One RL rollout batch decoded with `rl.sampler` and its row count."""
    import torch

    from dare_core.diffusion.seeding import sample_generators
    from dare_core.sampling.decode import generate

    rows, prompts, uids = prompts_of(cfg, tokenizer, cfg.rl.sampler.batch_size)

    def step(i: int) -> None:
        model.eval()
        with torch.no_grad():
            generate(model, prompts, cfg.rl.sampler, sample_generators((0, "rollout", i), uids))

    return step, len(rows)


def clean_env() -> dict:
    """This environment without the user's thread settings, the bench's code importable."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def cell(env: dict, seconds: float) -> dict:
    """One cell's measurements, in a fresh interpreter with `env`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--seconds", str(seconds)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"a cell failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def burners(n: int) -> Iterator[None]:
    """`n` CPU-bound processes (a busy loop each), as other jobs on a shared machine; killed after."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # running before the cells (and auto's look at the machine) start
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def run_load(burner_count: int, counts: list[int], seconds: float) -> dict:
    """Every cell of one load: {(threads, policy) or "auto": {workload: result}}."""
    base = clean_env()
    results: dict = {}
    with burners(burner_count):
        for n in counts:
            for policy in POLICIES:
                env = {**base, "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}
                if policy != "default":
                    env["OMP_WAIT_POLICY"] = policy
                results[(n, policy)] = cell(env, seconds)
                print(f"load {burner_count}: {n} threads {policy}: {fmt(results[(n, policy)])}", flush=True)
        # as `dare stage` starts its worker: the launcher looks at the machine, exports the count
        results["auto"] = cell(launcher_env("auto", 1, base), seconds)
        print(f"load {burner_count}: auto: {fmt(results['auto'])}", flush=True)
    return results


def fmt(result: dict) -> str:
    """A cell's progress line."""
    return ", ".join(f"{w} {v:.0f}/s" for w, v in result["samples_per_s"].items()) + f" ({result['reason']})"


def table(loads: dict, counts: list[int]) -> list[str]:
    """Samples/s of every fixed cell, the best of them, and auto beside it; a row per load and workload."""
    fixed_keys = [(n, p) for n in counts for p in POLICIES]
    columns = ["load", "workload"] + [f"{n} thr {p}" for n, p in fixed_keys] + ["best fixed", "auto (threads, wait policy)", "auto / best"]
    cells = []
    for label, results in loads.items():
        auto = results["auto"]
        for w in WORKLOADS:
            fixed = {key: results[key]["samples_per_s"][w] for key in fixed_keys}
            best = max(fixed, key=fixed.get)
            ours = auto["samples_per_s"][w]
            cells.append([label, w] + [f"{fixed[k]:.0f}" for k in fixed_keys] + [
                f"{fixed[best]:.0f} ({best[0]} thr {best[1]})", f"{ours:.0f} ({auto['threads']}, {auto['wait_policy']})",
                f"{ours / fixed[best]:.2f}"])
    return markdown_table(columns, cells)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="measured time per workload and cell, after a warm-up step")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one cell, in its own interpreter
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.seconds)))
        return
    command = "python3 bench/threads.py" + "".join(f" {shlex.quote(a)}" for a in (argv if argv is not None else sys.argv[1:]))
    commit, started, load_at_start = git_commit(), time.monotonic(), os.getloadavg()
    cores = usable_cores()
    # every count on a small machine; powers of two (and all cores) on a big one, to stay minutes long
    counts = sorted({*(2 ** i for i in range(cores.bit_length()) if 2 ** i <= cores), cores})
    levels = dict.fromkeys([0, cores // 2, cores])  # burner processes; a 1-core machine has two levels
    loads = {("idle" if n == 0 else f"{n} busy"): run_load(n, counts, args.seconds) for n in levels}
    from dare_core.config import load_config

    cfg = load_config(REPO / "params.yaml")
    lines = header("torch CPU threads on an idle and a busy machine", command, hardware(gpu=False, cpu_detail=True) + " (torch's CPU parallel backend: OpenMP)", commit)
    lines += [f"Samples/s of the embedded default model (params.yaml), each cell a fresh interpreter measured for "
              f"{args.seconds:g} s per workload after a warm-up step. sft: a {cfg.sft.micro_batch_size}-row "
              f"micro-batch step (masked loss, backward, clipping, AdamW); rollout: a {cfg.rl.sampler.batch_size}-prompt "
              "RL rollout batch (`rl.sampler`, forward only). Load: `N busy` = N busy-looping processes started by "
              "the bench; idle = none started (load average at the start: "
              f"{' / '.join(f'{x:.2f}' for x in load_at_start)} over 1 / 5 / 15 min, from other work on the machine). "
              "`default`: OpenMP's own wait policy (spin a while, then sleep); PASSIVE: OMP_WAIT_POLICY=PASSIVE. "
              "auto: the environment `dare stage` gives its worker, computed under the same load.", "",
              *table(loads, counts), "",
              "The cells of a load run one after another, so other work on the machine moves them: with one thread "
              "the wait policy does nothing, and the two 1-thread columns differ by that noise alone.  ",
              "auto's log line at each load: " + "; ".join(f"{k}: {v['auto']['reason']}" for k, v in loads.items()) + ".  ",
              f"Total wall time {time.monotonic() - started:.0f} s.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
