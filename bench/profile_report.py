"""bench/profile_step.py's results file: where the wall time of each profiled part goes by kind of
work, its top kernels, and (--compare) the same beside an earlier run's JSON."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from profile_summary import GAPS, SHARES
from stamp import header, markdown_table
from train_step_setup import SHAPES, Settings

LABELS = {"gemm": "GEMM", "attention": "attention", "sampling": "sampling", "copy": "copies", "other": "other kernels",
          GAPS: "launch gaps"}


def unit(row: dict) -> str:
    """What one profiled unit of a row is."""
    if row["phase"] == "denoise":
        graphs = ", CUDA graphs" if row["cuda_graphs"] else ""
        return (f"1 denoising step of {row['rollouts']} rollouts (mean of a {row['steps_per_block']}-step block of "
                f"{row['block_length']}, {row['cache']} cache{graphs})")
    work = "no gradients" if row["phase"] == "scoring" else "forward + backward"
    return f"1 micro-batch: {row['sequences']} sequences x {row['width']} columns ({row['tokens']:,} real tokens), {work}"


def wall_ms(summary: dict, kind: str) -> float:
    """Milliseconds of the unit's wall time that a kind of work (or the launch gaps) takes."""
    return summary["shares"][kind] * max(summary["wall_us"], summary["busy_us"]) / 1e3


def shares_table(rows: list[dict]) -> list[str]:
    columns = ["model", "part", "one unit", "wall ms", "kernels / unit"] + [LABELS[k] for k in SHARES]
    cells = []
    for r in rows:
        head = [SHAPES[r["shape"]], r["phase"]]
        if "error" in r:
            cells.append(head + [r["error"]] + [""] * (len(columns) - 3))
            continue
        s = r["summary"]
        launches = sum(calls for calls, _ in r["per_step"]["kernels"].values())
        cells.append(head + [unit(r), f"{s['wall_us'] / 1e3:.2f}", f"{launches:,.0f}"] + [f"{s['shares'][k]:.1%}" for k in SHARES])
    return markdown_table(columns, cells)


def kernel_cell(name: str, width: int = 110) -> str:
    """A kernel's name in a table cell: C++ template names run to hundreds of characters (the JSON has them whole)."""
    name = name.removeprefix("void ").replace("|", "\\|").replace("`", "'")
    return f"`{name[:width]}…`" if len(name) > width else f"`{name}`"


def top_tables(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            continue
        cells = [[i + 1, kernel_cell(k["name"]), LABELS[k["category"]], f"{k['calls']:,.1f}", f"{k['us'] / 1e3:.3f}",
                  f"{k['share']:.1%}"] for i, k in enumerate(r["summary"]["top"])]
        out += [f"### {SHAPES[r['shape']]}: {r['phase']}", ""]
        out += markdown_table(["#", "kernel", "kind", "launches / unit", "GPU ms / unit", "share of GPU time"], cells) + [""]
    return out


def compare_table(rows: list[dict], before: dict) -> list[str]:
    """Each part beside the same part (model and phase) of an earlier run: wall ms, and ms by kind."""
    earlier = {(r["shape"], r["phase"]): r for r in before["rows"] if "error" not in r}
    columns = ["model", "part", "wall ms before", "wall ms after", "after / before"] + [f"{LABELS[k]} ms" for k in SHARES]
    cells = []
    for r in rows:
        b = earlier.get((r["shape"], r["phase"]))
        if b is None or "error" in r:
            continue
        old, new = b["summary"], r["summary"]
        cells.append([SHAPES[r["shape"]], r["phase"], f"{old['wall_us'] / 1e3:.2f}", f"{new['wall_us'] / 1e3:.2f}",
                      f"{new['wall_us'] / old['wall_us']:.2f}x"]
                     + [f"{wall_ms(old, k):.2f} → {wall_ms(new, k):.2f}" for k in SHARES])
    return markdown_table(columns, cells)


def how_lines(s: Settings) -> list[str]:
    return [
        f"- What runs: the RL stage of bench/train_step.py's `rl` part (d1, {s.rl_prompts} prompts x {s.rl_group} rollouts, "
        f"gen {s.rl_gen}, {s.rl_denoise_steps} denoising steps, block {s.rl_block} (SDAR: its block of 4), dual cache (SDAR: "
        f"block_kv) and CUDA graphs of forwards through one compiled layer call on the GPU, LoRA r {s.rl_lora[0]}, "
        f"micro-batches of {s.rl_micro}, KL {s.rl_kl}), built by the stage itself on a random-weight model folder of the "
        "real shape; its step 0's rollouts are drawn first (they warm the sampler up) and the parts below are profiled on them.",
        "- denoise: the sampler's own loop on the rollout batch, decoding two blocks less decoding one block, divided by the "
        "block's steps (the loop has no cut inside a block, and the first block carries the once-per-rollout work: the "
        "canvas, the prompt's prefill, the outputs). One step is so the mean step of a block: LLaDA's dual cache "
        "re-encodes the whole canvas at each block's first step, SDAR's block_kv encodes the finished block once more.",
        "- scoring: one micro-batch of the old policy's scores (`algo.score`, no gradients); training: one micro-batch's "
        "`algo.update`, forward and backward through the DeepSpeed engine, the optimizer step apart.",
        "- wall ms: the median of unprofiled runs after warm-up runs, GPU synchronised; kernels: one run under torch.profiler "
        "(traces beside the rows in the JSON). Launch gaps: the wall time with no kernel running (launches, host work, "
        "syncs); the busy time is split over the kinds in proportion to their kernel time. The shares sum to 100 %. Where "
        "a wall time comes out under the busy time (the denoise step's is the difference of two medians: noise), the busy "
        "time stands for it and the gaps are 0.",
        "- Kinds by kernel name (bench/profile_summary.py `kernel_category`): GEMM (cuBLAS, CUTLASS, matmul templates), "
        "attention (flash/memory-efficient/cuDNN SDPA, FlexAttention), sampling (softmax-family reductions over the "
        "logits, random draws, argmax/top-k/sort), copies (copy, cat, index, gather/scatter, fill, memcpy/memset), other "
        "(elementwise, norms, other reductions, Inductor's fused kernels; the Gumbel arithmetic's elementwise kernels among them).",
    ]


def report(data: dict, s: Settings, tiny: bool, compare: Optional[tuple[Path, dict]] = None) -> str:
    runs, rows = data["runs"], data["rows"]
    last = runs[-1]
    note = (" (--tiny: a shrunken model on the CPU, its operators in place of kernels; the numbers check the script and "
            "measure nothing)") if tiny else ""
    lines = header(f"Profile of one RL step's parts at the LLaDA-8B and SDAR-8B shapes{note}", last["command"], last["hardware"],
                   last["commit"], last["libraries"], last["date"])
    earlier = [f"Earlier command (rows kept by --add): `{run['command']}` ({run['date']})  " for run in runs[:-1]]
    lines[4:4] = earlier
    lines += how_lines(s) + ["", "## Where the wall time goes (share of one unit's wall time)", ""] + shares_table(rows) + [""]
    lines += ["## Top kernels by GPU time (per unit)", ""] + top_tables(rows)
    if compare is not None:
        path, before = compare
        commit = before["runs"][-1]["commit"] if before.get("runs") else "?"
        lines += [f"## Against {path} (commit {commit})", ""] + compare_table(rows, before) + [""]
    return "\n".join(lines)
