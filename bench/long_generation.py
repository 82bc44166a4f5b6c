"""Memory and time per step of the long-generation RL preset (configs/long_generation.yaml) at its
model's real shape: the real RL stage loop with the preset applied as a user applies it
(`recipe=<file>`), and only what cannot be real here swapped in: the model folder (random bf16
weights of the real config.json, bench/train_step_setup.py), the prompts (synthetic text) and the
reward (a hash of the response's text: random weights answer nothing, and every group still gets
a spread of rewards). `--set` changes any setting as `-S` does (fewer prompts, another length).

The stage runs in a child process; the parent rewrites the results file after every logged step,
so a run stopped by `--budget` (or killed) keeps the steps it finished. Step 1 captures the CUDA
graphs and compiles; the steps after it are the steady state.

  python3 bench/long_generation.py [--preset configs/long_generation.yaml] [--set rl.num_steps=2 ...]
      [--workdir /tmp/long_generation] [--out bench/results/long_generation.md] [--budget S] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_pieces import REWARD  # noqa: E402
from stamp import REPO, fmt, git_commit, hardware, header, markdown_table, write_atomic  # noqa: E402
from train_step_runs import RL_PHASES, child_env, link_start_folder, metrics_rows, rank_env, run_rl_on_folder, torchrun  # noqa: E402
from train_step_setup import Settings, write_data, write_model_folder  # noqa: E402

STOP_BASE = 1000  # --stop-tokens N makes N ids from here stop tokens (ordinary tokens; from vocab / 8 in a smaller vocabulary)
SHAPE_OF_FAMILY = {"llada": "llada", "sdar": "sdar"}  # the 8B shapes bench/configs holds
PHASE_NAMES = {"rollout": "rollout", "reward": "reward", "scoring": "old+ref scoring", "forward_backward": "fwd+bwd",
               "optimizer": "optimizer"}


def stage_overrides(workdir: Path, folder: Path, preset: Path, sets: list[str]) -> list[str]:
    """The preset, then what the bench owns (where things are, the reward, no checkpoints or
    validation), then the caller's --set."""
    own = {"run.name": "long_generation", "run.seed": 0, "run.runs_dir": str(workdir / "runs"),
           "run.models_dir": str(workdir / "models"), "run.metrics_dir": str(workdir / "runs" / "metrics"),
           "data.prepared_dir": str(workdir / "data"), "data.tokenizer_dir": str(folder), "model.path": str(folder),
           "rl.reward": REWARD, "rl.reward_args": {}, "rl.validate_every": 0, "rl.save_every": 10**9, "rl.log_every": 1,
           "rl.num_steps": 2}
    return [f"recipe={preset}", *(f"{k}={json.dumps(v)}" for k, v in own.items()), *sets]


def child_main(spec_path: Path) -> int:
    """Run the RL stage loop with the spec's overrides, from the shape's folder."""
    from dare_core.config import load_config

    spec = json.loads(spec_path.read_text())
    if spec.get("keep_canvas"):  # the comparison: every rollout scored and trained over its whole canvas
        from dare_core.algorithms.base import RLAlgorithm

        RLAlgorithm.trims_after_stop = property(lambda self: False)
    run_rl_on_folder(load_config(REPO / "params.yaml", spec["overrides"]), spec["folder"])
    return 0


def describe(cfg) -> str:
    """The settings that decide a step's memory and time, as the stage read them."""
    s, m, rl = cfg.rl.sampler, cfg.model, cfg.rl
    lora = f"LoRA r {m.lora['r']}, alpha {m.lora['alpha']}" if m.lora else "full parameters"
    return (f"{rl.algorithm}, {rl.prompts_per_step} prompts x {rl.group_size} rollouts, gen {s.gen_length} (block {s.block_length}, "
            f"at most {s.steps} steps, unmasking {s.unmasking} {s.threshold}), cache {s.cache}, {s.batch_size} rollouts decoded "
            f"at once, {rl.num_iterations} inner iterations of micro-batches of {rl.micro_batch_size}, KL {rl.kl_beta}; "
            f"{lora}, gradient checkpointing {'on' if m.gradient_checkpointing else 'off'}, packing {m.packing}, "
            f"logits_chunk {m.logits_chunk}, {cfg.launch.nproc} rank(s), sequence_parallel {cfg.launch.sequence_parallel}")


CANVAS = {"trim": "scoring and training leave out the canvas after each rollout's stop-token block where the objective "
                  "allows it (d1 on block diffusion)",
          "keep": "every rollout scored and trained over its whole canvas, the tokens after its stop included (the stage "
                  "before it left them out)"}


def write_results(out: Path, command: str, commit: str, settings: dict, runs: list[dict]) -> None:
    """One table per run (`--canvas both`: trimmed, then the whole canvas, back to back on one machine)."""
    lines = header("Long-generation RL: memory and time per step", command, hardware(), commit)
    lines += [f"- Preset: `{settings['preset']}`; the stage read: {settings['described']}.",
              "- The real RL stage loop with the preset applied as `recipe=`; random bf16 weights of the model's real "
              "config.json, synthetic prompts, a hash-of-the-text reward (random weights answer nothing). Phase times "
              "from the loop's metrics (`DARE_PHASE_TIMES`, the GPU synchronised at each phase boundary); step 1 "
              "captures the CUDA graphs and compiles.",
              *([f"- Responses of different lengths: {settings['stop_tokens']} token ids made stop tokens "
                 f"(`rl.sampler.stop_token_ids`, ids {settings['first_stop']}-{settings['first_stop'] + settings['stop_tokens'] - 1}), "
                 "so that random weights end a response after about vocab / N tokens; a finished rollout decodes no "
                 "further block."] if settings.get("stop_tokens") else []),
              *([f"- {settings['ranks']} ranks (one a GPU, started by torchrun), each decoding and training its share of the "
                 "prompts; phase times and peak memory are rank 0's."] if settings.get("ranks", 1) > 1 else [])]
    for run in runs:
        steps = run["steps"]
        startup = next((m.get("time/startup_s") for m in steps if m.get("time/startup_s") is not None), None)
        rows = [[m["step"], *(fmt(m.get(f"time/{p}_s"), ".1f") for p in RL_PHASES), fmt(m.get("time/step_s"), ".1f"),
                 fmt(m.get("response_tokens"), ".0f"), fmt(m.get("rollout_steps"), ".0f"), fmt(m.get("sequence_tokens"), ".0f"),
                 fmt(m.get("memory/peak_gib"), ".1f", "n/a (CPU)")] for m in steps]
        lines += ["", f"## Canvas: {run['canvas']}", "", f"- {CANVAS[run['canvas']].capitalize()}.",
                  f"- Stage start-up (checks, load, engine) before step 1: {fmt(startup, '.1f', 'n/a')} s.",
                  f"- Status: {run['status']}.", ""]
        lines += markdown_table(["step", *(f"{PHASE_NAMES[p]} s" for p in RL_PHASES), "step s", "response tokens (mean)",
                                 "denoising steps a rollout (mean)", "tokens scored a rollout, prompt included (mean)",
                                 "peak GPU memory (GiB)"], rows)
    write_atomic(out, "\n".join(lines) + "\n")
    write_atomic(out.with_suffix(".json"), json.dumps({"commit": commit, "command": command, "settings": settings,
                                                       "runs": runs}, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", type=Path, default=REPO / "configs" / "long_generation.yaml")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="settings over the preset, as -S takes them")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/long_generation"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "long_generation.md")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds each run of the stage may take (0: no limit); its finished steps are kept")
    ap.add_argument("--stop-tokens", type=int, default=0, metavar="N",
                    help="N token ids made stop tokens (rl.sampler.stop_token_ids): random weights then end each response "
                         "after about vocab/N tokens, so that responses of one batch differ in length")
    ap.add_argument("--canvas", choices=["trim", "keep", "both"], default="trim",
                    help="keep: score and train every rollout over its whole canvas, the tokens after its stop included "
                         "(what the stage did before it left them out); both: trim, then keep, one table each")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the model's two-layer, narrow version")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.workdir = args.workdir.resolve()  # the stage's start folder is a link to a folder in it
    if args.child:
        return child_main(args.child)

    from dare_core.config import load_config

    commit = git_commit()
    command = "python3 bench/long_generation.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    # the family as the stage will read it (the preset, what it extends, --set), before any folder exists
    family = load_config(REPO / "params.yaml", [f"recipe={args.preset.resolve()}", *args.set]).model.family
    if family not in SHAPE_OF_FAMILY:
        raise SystemExit(f"{args.preset}: no bench shape of family {family} (known: {sorted(SHAPE_OF_FAMILY)})")
    shape = SHAPE_OF_FAMILY[family]
    folder = args.workdir / "models" / (f"{shape}-tiny" if args.tiny else shape)
    if not (folder / "config.json").exists():
        print(f"[long_generation] writing a random {shape} folder to {folder} ...", flush=True)
        write_model_folder(shape, folder, args.tiny)
    first_stop = min(STOP_BASE, json.loads((folder / "config.json").read_text())["vocab_size"] // 8)
    stops = [f"rl.sampler.stop_token_ids={json.dumps(list(range(first_stop, first_stop + args.stop_tokens)))}"] if args.stop_tokens else []
    overrides = stage_overrides(args.workdir, folder, args.preset.resolve(), [*stops, *args.set])
    cfg = load_config(REPO / "params.yaml", overrides)
    ranks = cfg.launch.nproc
    write_data(args.workdir / "data", Settings(rl_prompts=cfg.rl.prompts_per_step))
    settings = {"preset": str(args.preset.resolve().relative_to(REPO)) if args.preset.resolve().is_relative_to(REPO)
                else str(args.preset), "set": args.set, "described": describe(cfg), "ranks": ranks,
                "stop_tokens": args.stop_tokens, "first_stop": first_stop}
    print(f"[long_generation] {settings['described']}", flush=True)
    runs: list[dict] = []
    for canvas in (["trim", "keep"] if args.canvas == "both" else [args.canvas]):
        runs.append({"canvas": canvas, "status": "running", "steps": []})
        run_stage(cfg, args, folder, overrides, canvas, lambda: write_results(args.out, command, commit, settings, runs), runs[-1])
    write_results(args.out, command, commit, settings, runs)
    print(f"[long_generation] {'; '.join(r['status'] for r in runs)}; wrote {args.out}", flush=True)
    return 0 if all(r["status"] == "finished" for r in runs) else 1


def run_stage(cfg, args, folder: Path, overrides: list[str], canvas: str, write, run: dict) -> None:
    """One run of the stage in a child (torchrun's ranks for launch.nproc > 1); `run` gets its logged
    steps and status as they come, and `write()` rewrites the results file after each poll."""
    ranks = cfg.launch.nproc
    stage_dir = cfg.stage_dir("rl")
    (stage_dir / "metrics.jsonl").unlink(missing_ok=True)
    link_start_folder(cfg, str(folder))
    spec = args.workdir / "spec.json"
    spec.write_text(json.dumps({"overrides": overrides, "folder": str(folder), "keep_canvas": canvas == "keep"}))
    log = args.workdir / f"stage_{canvas}.log"
    print(f"[long_generation] canvas {canvas}: stage log {log}", flush=True)
    t0 = time.monotonic()
    with log.open("w") as out:
        launcher = torchrun(ranks) if ranks > 1 else [sys.executable]
        proc = subprocess.Popen([*launcher, __file__, "--child", str(spec)], env=rank_env(ranks) if ranks > 1 else child_env(), cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            code = proc.poll()
            steps = [m for m in metrics_rows(stage_dir) if "time/step_s" in m]
            for m in steps[len(run["steps"]):]:
                print(f"[long_generation] step {m['step']}: {m['time/step_s']:.1f} s, peak "
                      f"{fmt(m.get('memory/peak_gib'), '.1f', 'n/a')} GiB", flush=True)
            run["steps"] = steps
            if code is not None:
                run["status"] = "finished" if code == 0 else f"the stage failed (exit {code}): " + _tail(log)
                break
            if args.budget and time.monotonic() - t0 > args.budget:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                run["status"] = f"stopped by --budget {args.budget:g} s after {len(steps)} step(s)"
                break
            write()
            time.sleep(2)
    run["steps"] = [m for m in metrics_rows(stage_dir) if "time/step_s" in m]


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " / ".join(lines[-3:])[-600:]


if __name__ == "__main__":
    sys.exit(main())
