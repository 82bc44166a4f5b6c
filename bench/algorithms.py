"""Every RL algorithm on the embedded task, from the same SFT checkpoint with the same rollout budget.

    .venv/bin/python bench/algorithms.py                      # all algorithms, masked + block families
    .venv/bin/python bench/algorithms.py --only d1 spg --steps 20

Masked diffusion: the embedded default's SFT checkpoint (runs/<--sft-run>/sft, trained by
`dare stage sft` if missing) is the start of every run. Block diffusion (EBPO and the algorithms
defined for both kinds): a tiny SDAR model is trained by SFT on the same task first. Each algorithm
then runs `dare stage rl`, `convert` and `eval` (the workers DVC runs) with params.yaml's RL settings
(prompts per step, group size, inner iterations, optimiser, sampler) and only the overrides listed in
ALGORITHM_SETTINGS, so every algorithm gets the same rollouts per step and the same number of steps.
Writes bench/results/algorithms.md (held-out accuracy of SFT and RL, wall time per step) and
bench/results/algorithms_reward.png (rollout reward per step).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit, hardware, header, markdown_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# The only per-algorithm settings. The embedded prompts are terse arithmetic ("123+45="), so the
# prompt-noise regulariser of d1/SPG would hide digits the answer depends on: off, as in params.yaml.
ALGORITHM_SETTINGS: dict[str, list[str]] = {
    "d1": ["rl.algorithm_args={d1: {p_mask_prompt: 0.0}}"],
    "coupled_grpo": [],
    "cj_grpo": [],
    "spg": ["rl.algorithm_args={spg: {p_mask_prompt: 0.0, num_t: 1}}"],  # num_t 1: as measured (the default is now 2)
    "bgpo": [],
    "mdpo": [],
    "espo": [],
    # its rollout is left to right by construction: block 1, one token per step
    "just_grpo": ["rl.sampler.block_length=1"],
    # a tree of 4 root children x 2 = 8 leaves per prompt: the same 8 completed responses per prompt
    # as the others' group of 8 (and fewer denoising forwards: the leaves share their parents' steps);
    # 12 transitions per prompt make the mini-batch 192 rows
    "d_tree_rpo": ["rl.algorithm_args={d_tree_rpo: {num_tree_samples: 4, branch_factor: 2}}", "rl.micro_batch_size=192"],
    # a second BGPO row with a smaller step size (see the results note)
    "bgpo:lr3e-5": ["rl.optim.lr=3e-5"],
    # 8 Monte-Carlo rows instead of 16 on the CPU: each row is a two-stream forward of the whole canvas
    "ebpo": ["rl.algorithm_args={ebpo: {mc_num: 8}}"],
}
MASKED = ["d1", "coupled_grpo", "cj_grpo", "spg", "bgpo", "bgpo:lr3e-5", "mdpo", "espo", "just_grpo", "d_tree_rpo"]
BLOCK = ["ebpo", "cj_grpo", "d1"]

# the tiny SDAR model of the block section: gen_length 6 is not a multiple of its block of 4
SDAR = [
    "model.family=sdar",
    "model.init={hidden_size: 128, num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 4, head_dim: 32, "
    "intermediate_size: 384, max_position_embeddings: 32, block_size: 4}",
    "sft.pad_to=8", "rl.sampler.gen_length=8", "rl.sampler.block_length=4", "rl.sampler.steps=8",
    "eval.sampler.gen_length=8", "eval.sampler.block_length=4", "eval.sampler.steps=8",
]


def stage(name: str, sets: list[str], params: str) -> float:
    t0 = time.time()
    cmd = [sys.executable, "-m", "dare_core.cli", "stage", name, "--params", params] + [f"--set={s}" for s in sets]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if name != "rl" else None)
    return time.time() - t0


def link_sft(run: str, sft_run: str, runs_dir: Path) -> None:
    """Start run `run` from the SFT (and base) of `sft_run`."""
    (runs_dir / run).mkdir(parents=True, exist_ok=True)
    for part in ("sft", "base"):
        link = runs_dir / run / part
        if link.is_symlink():
            link.unlink()
        link.symlink_to(Path("..") / sft_run / part)


def run_algorithm(algo: str, kind: str, sft_run: str, base_sets: list[str], params: str, runs_dir: Path) -> dict:
    run = f"algos_{kind}_{algo.replace(':', '_')}"
    done = runs_dir / run / "bench.json"
    if done.exists():  # finished in an earlier invocation of this commit, same settings: reuse its row
        row = json.loads(done.read_text())
        if row.get("sets") == base_sets + ALGORITHM_SETTINGS.get(algo, []) and row.get("commit") == git_commit():
            return {**row, "reused": True}
    link_sft(run, sft_run, runs_dir)
    sets = base_sets + [f"run.name={run}", f"run.metrics_dir={runs_dir}/{run}/metrics", f"rl.algorithm={algo.split(':')[0]}"] + ALGORITHM_SETTINGS.get(algo, [])
    wall = stage("rl", sets, params)
    stage("convert", sets, params)
    stage("eval", sets, params)
    acc = json.loads((runs_dir / run / "metrics" / "eval.json").read_text())
    log = [json.loads(line) for line in (runs_dir / run / "rl" / "metrics.jsonl").read_text().splitlines()]
    log = [m for m in log if "reward" in m]  # training steps only (step 0 holds only validation)
    row = {
        "algorithm": algo, "kind": kind, "sft": acc["sft"]["arithmetic"] / 100, "rl": acc["rl"]["arithmetic"] / 100,
        "step_s": statistics.mean(m["step_time_s"] for m in log), "rollout_s": statistics.mean(m["rollout_time_s"] for m in log),
        "wall_s": wall, "reward": [(m["step"], m["reward"]) for m in log], "sets": base_sets + ALGORITHM_SETTINGS.get(algo, []),
        "steps": len(log), "commit": git_commit(),
    }
    done.write_text(json.dumps(row))
    return row


def table(rows: list[dict]) -> str:
    columns = ["family", "algorithm", "RL steps", "SFT accuracy", "RL accuracy", "change", "s per step (rollout)", "RL stage wall (s)"]
    return "\n".join(markdown_table(columns, [
        [r["kind"], r["algorithm"], r.get("steps", len(r["reward"])), f"{r['sft']:.3f}", f"{r['rl']:.3f}", f"{r['rl'] - r['sft']:+.3f}",
         f"{r['step_s']:.2f} ({r['rollout_s']:.2f})", f"{r['wall_s']:.0f}"] for r in rows]))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for r in (r for r in rows if r["kind"] == kind):
            steps, rewards = zip(*r["reward"])
            window = 5  # moving average: one step's reward is a mean over only 16 prompts
            smooth = [statistics.mean(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
            ax.plot(steps, smooth, label=r["algorithm"])
        ax.set_title(f"{kind} diffusion: rollout reward (moving average of 5 steps)")
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean reward of the step's rollouts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--steps", type=int, default=None, help="RL steps per algorithm (default: params.yaml's rl.num_steps)")
    p.add_argument("--only", nargs="*", help="algorithms to run (default: all)")
    p.add_argument("--kinds", nargs="*", default=["masked", "block"])
    p.add_argument("--sft-run", default="embedded", help="run whose SFT checkpoint the masked algorithms start from")
    p.add_argument("--sdar-sft-steps", type=int, default=3000)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "algorithms.md"))
    args = p.parse_args()
    from dare_core.config import load_config

    cfg = load_config(REPO / args.params)
    runs_dir = REPO / cfg.run.runs_dir
    steps = args.steps or cfg.rl.num_steps
    common = [f"rl.num_steps={steps}", f"rl.save_every={steps}", "rl.log_every=1"]
    rows: list[dict] = []
    t_start, commit = time.time(), git_commit()  # the code the run starts with (a long run outlives commits)
    for kind in args.kinds:
        if kind == "masked":
            sft_run, base_sets = args.sft_run, list(common)
            names = MASKED
        else:
            sft_run, base_sets = "algos_block_sft", common + SDAR
            names = BLOCK
        if not (runs_dir / sft_run / "sft" / "model").exists():
            print(f"training the {kind} SFT checkpoint ({sft_run})", flush=True)
            sets = base_sets + [f"run.name={sft_run}", f"run.metrics_dir={runs_dir}/{sft_run}/metrics"]
            if kind == "block":
                sets.append(f"sft.max_steps={args.sdar_sft_steps}")
            stage("sft", sets, args.params)
        for algo in names:
            if args.only and algo not in args.only:
                continue
            print(f"== {kind}: {algo}", flush=True)
            rows.append(run_algorithm(algo, kind, sft_run, base_sets, args.params, runs_dir))
            print(table(rows), flush=True)
    rows.sort(key=lambda r: (r["kind"] != "masked",))
    png = Path(args.out).with_name("algorithms_reward.png")
    plot(rows, png)
    command = "python3 bench/algorithms.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    text = (
        "\n".join(header("Every RL algorithm on the embedded task", command.strip(), hardware(gpu=False, cpu_detail=True), commit)) + "\n"
        f"Budget: {steps} RL steps (block family: see its rows' step counts) x {cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} rollouts for every algorithm, "
        f"{cfg.rl.num_iterations} inner iterations, the optimiser and sampler of params.yaml; per-algorithm settings: "
        "`ALGORITHM_SETTINGS` in bench/algorithms.py. Accuracy: the eval stage (500 held-out problems, the eval sampler "
        f"of params.yaml). Total wall time {time.time() - t_start:.0f} s"
        + (f" (rows of {', '.join(r['algorithm'] for r in rows if r.get('reused'))} were measured by an earlier invocation of "
           "this commit and reused)" if any(r.get("reused") for r in rows) else "") + ".\n\n"
        + table(rows) + f"\n\n![rollout reward per step]({png.name})\n"
    )
    Path(args.out).write_text(text)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
