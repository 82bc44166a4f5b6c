"""bench/train_step.py's results file: the tables, the issue's targets computed from the rows, and
the rows of several runs merged into one file (--add, --merge)."""
from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Optional

from stamp import fmt, markdown_table
from train_step_runs import ENGINE_PHASES, ENGINE_SAMPLER, EXPORT_PHASES, RL_PHASES, STARTUP_PHASES
from train_step_setup import SHAPES, Settings

def same_run(a: dict, b: dict) -> bool:
    """Ratios are taken between rows of one invocation only (a merged file holds several): two runs
    differ in machine state and, possibly, commit."""
    return a.get("run") == b.get("run")


SFT_COLUMNS = ["run", "model", "training", "packing", "sequences / step", "real tokens / step", "padded tokens / step",
               "s / step", "fwd+bwd s", "optimizer s", "tokens/s", "MFU", "peak mem (GiB)", "packed speed-up"]
RL_COLUMNS = ["run", "model", "recipe", "step", "rollout s", "reward s", "old+ref scoring s", "fwd+bwd s", "optimizer s",
              "other s", "step s", "training pass MFU", "rollout: share of bf16 peak", "groups with zero reward spread",
              "peak mem (GiB)", "speed-up vs d1's code"]
STARTUP_COLUMNS = ["run", "model", "stage", "process start to stage s", "start-up s (target <= 30)", "checks s", "load s",
                   "engine s", "export of the merged model s (target <= 30)", "export: merge s", "export: copy off the GPU s",
                   "export: waiting for the disk s", "export: open/close s"]


def with_error(head: list, error: str, columns: list) -> list:
    """A row that failed: what ran, the error in the first measured column, the rest empty."""
    return head + [error] + [""] * (len(columns) - len(head) - 1)


def sft_table(rows: list[dict]) -> list[str]:
    cells = []
    for r in rows:
        head = [fmt(r.get("run"), "d"), SHAPES[r["shape"]], "LoRA" if r["training"] == "lora" else "full (ZeRO-3, CPU optimizer)",
                f"{r['packing']}{' + compile' if r.get('compile') else ''}"]
        if "error" in r:
            cells.append(with_error(head, r["error"], SFT_COLUMNS))
            continue
        other = next((o for o in rows if o["shape"] == r["shape"] and o["training"] == r["training"] and same_run(o, r)
                      and o["packing"] == "off" and not o.get("compile") and "error" not in o), None)
        speedup = f"{other['step_s'] / r['step_s']:.2f}x" if r["packing"] == "on" and other else ""
        cells.append(head + [f"{r['sequences']:.0f}", f"{r['real_tokens']:,.0f}", f"{r['padded_tokens']:,.0f}", f"{r['step_s']:.3f}",
                             fmt(r["fwd_bwd_s"], ".3f"), fmt(r["optimizer_s"], ".3f"), f"{r['tokens_per_s']:,.0f}",
                             fmt(r["mfu"], ".1%") or "n/a (CPU)", fmt(r["peak_gib"], ".1f") or "n/a (CPU)", speedup])
    return markdown_table(SFT_COLUMNS, cells)


# what ran a row: DARE, d1's own code, or (rows of commits before 80fcd47) the bench's transcription of d1's recipe
RECIPES = {"dare": "DARE", "d1": "d1's own code", "public": "public d1 recipe (transcribed)"}
UNKNOWN_D1 = "not compared: d1's commit is unknown (bench/.peers/d1 is not a git checkout of dllm-reasoning/d1)"


def unknown_commit(row: dict) -> bool:
    """A measured row of d1's own code without its checkout's commit: no ratio is given against code
    of an unknown version."""
    return row.get("recipe") == "d1" and "error" not in row and not row.get("d1_commit")


def rl_table(rows: list[dict]) -> list[str]:
    cells = []
    for r in rows:
        recipe = RECIPES[r["recipe"]] + (f" @{r['d1_commit'][:7]}" if r.get("d1_commit") else "")
        recipe += " @unknown commit" if unknown_commit(r) else ""
        recipe += " + compile" if r.get("compile") else ""
        recipe += ", merged-LoRA rollouts" if r.get("lora_merged") else ""
        head = [fmt(r.get("run"), "d"), SHAPES[r["shape"]], recipe]
        if "error" in r:
            cells.append(with_error(head + [""], r["error"], RL_COLUMNS))
            continue
        peer = next((o for o in rows if o["shape"] == r["shape"] and o["recipe"] == "d1" and same_run(o, r)
                     and "error" not in o), None)
        speedup = ""
        if r["recipe"] == "dare" and peer:
            speedup = UNKNOWN_D1 if unknown_commit(peer) else f"{peer['step_s'] / r['step_s']:.2f}x"
        cells.append(head + [r["step"]] + [f"{r[p]:.2f}" for p in RL_PHASES] + [
            f"{r['other']:.2f}", f"{r['step_s']:.2f}", fmt(r.get("train_mfu"), ".1%"), fmt(r.get("rollout_peak"), ".1%"), fmt(r["zero_std_ratio"], ".0%"),
            fmt(r["peak_gib"], ".1f") or "n/a (CPU)", speedup])
    return markdown_table(RL_COLUMNS, cells)


ENGINE_COLUMNS = ["run", "model", "rollouts", "step", "rollout s", "reward s", "old+ref scoring s", "fwd+bwd s", "optimizer s",
                  "weight sync s", "other s", "step s", "mean reward", "peak mem (GiB)", "step vs native"]


def engine_table(rows: list[dict]) -> list[str]:
    """The rl-engines rows: one step with each engine's rollouts, the weight push to lmdeploy included."""
    cells = []
    for r in rows:
        head = [fmt(r.get("run"), "d"), SHAPES[r["shape"]], r["recipe"]]
        if "error" in r:
            cells.append(with_error(head + [""], r["error"], ENGINE_COLUMNS))
            continue
        native = next((o for o in rows if o["shape"] == r["shape"] and o["recipe"] == "native" and same_run(o, r)
                       and "error" not in o), None)
        cells.append(head + [r["step"]] + [f"{r[p]:.2f}" for p in ENGINE_PHASES] + [
            f"{r['other']:.2f}", f"{r['step_s']:.2f}", fmt(r.get("mean_reward"), ".3f"), fmt(r["peak_gib"], ".1f") or "n/a (CPU)",
            f"{native['step_s'] / r['step_s']:.2f}x" if native and r["recipe"] != "native" else ""])
    return markdown_table(ENGINE_COLUMNS, cells)


def export_parts(row: dict) -> dict:
    # rows of commit 92d9a75 recorded the disk wait alone
    return row.get("export_parts") or {"disk_wait": row.get("export_disk_wait_s")}


def startup_table(rows: list[dict]) -> list[str]:
    cells = []
    for r in rows:
        if r["part"] == "folder" or "error" in r or r.get("startup_s") is None:
            continue
        run = (f"SFT {r['training']} packing {r['packing']}{' + compile' if r.get('compile') else ''}"
               if r["part"].startswith("sft") else f"RL ({r['recipe']}{' + compile' if r.get('compile') else ''})")
        cells.append([fmt(r.get("run"), "d"), SHAPES[r["shape"]], run, fmt(r.get("launch_s"), ".1f"), f"{r['startup_s']:.1f}"]
                     + [fmt(r["startup_parts"].get(p), ".1f") for p in STARTUP_PHASES] + [fmt(r.get("export_s"), ".1f")]
                     + [fmt(export_parts(r).get(p), ".1f") for p in EXPORT_PHASES])
    return markdown_table(STARTUP_COLUMNS, cells)


def acceptance(rows: list[dict], runs: Optional[list[dict]] = None) -> list[str]:
    """The issue's targets, computed from each run's own rows (a merged file holds several runs)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get("run"), []).append(r)
    if len(groups) <= 1:
        return run_acceptance(rows)
    out = []
    for run, group in sorted(groups.items(), key=lambda item: -1 if item[0] is None else item[0]):
        lines = run_acceptance(group)
        if lines != ["- nothing to compare in this run"]:
            commit = runs[run]["commit"][:7] if runs and run is not None and run < len(runs) else "?"
            out.append(f"- run {run} (commit {commit}):")
            out += ["  " + line for line in lines]
    return out or ["- nothing to compare in this run"]


def run_acceptance(rows: list[dict]) -> list[str]:
    """The targets from the rows of one run (LLaDA-8B shape)."""
    def find(**keys):  # (rows of runs before the RL compile variant carry no "compile": eager)
        return next((r for r in rows if all(r.get(k, False if k == "compile" else None) == v for k, v in keys.items())
                     and "error" not in r), None)

    out = []
    # packed eager, and packed compiled where that was run, each against the padded eager run
    padded = find(shape="llada", part="sft", packing="off", compile=False)
    for compiled, target in ((False, 0.45), (True, 0.50)):
        packed = find(shape="llada", part="sft", packing="on", compile=compiled)
        how = " + compile" if compiled else ""
        if packed and packed.get("mfu") is not None:
            out.append(f"- packed{how} LoRA SFT at LLaDA-8B: MFU {packed['mfu']:.1%} (target >= {target:.0%}): "
                       f"{'met' if packed['mfu'] >= target else 'not met'}")
        if packed and padded and same_run(packed, padded):
            ratio = padded["step_s"] / packed["step_s"]
            out.append(f"- packed{how} vs padded LoRA SFT at LLaDA-8B: {ratio:.2f}x (target >= 1.7x): "
                       f"{'met' if ratio >= 1.7 else 'not met'}")
    peer = find(shape="llada", part="rl-d1")
    for compiled in (False, True):
        ours, how = find(shape="llada", part="rl", compile=compiled), " + compile" if compiled else ""
        if ours and peer and not same_run(ours, peer):
            out.append(f"- RL step{how} at LLaDA-8B vs d1's own code: not compared (DARE {ours['step_s']:.1f} s and d1 "
                       f"{peer['step_s']:.1f} s come from different runs)")
        elif ours and peer and unknown_commit(peer):
            out.append(f"- RL step{how} at LLaDA-8B vs d1's own code: {UNKNOWN_D1}")
        elif ours and peer:
            ratio = peer["step_s"] / ours["step_s"]
            verdict = "met" if ratio >= 10 else "not met (the 8x floor met)" if ratio >= 8 else "not met"
            out.append(f"- RL step{how} at LLaDA-8B vs d1's own code: {ratio:.2f}x (target >= 10x, 8x the floor): {verdict}")
        if ours and ours.get("rollout_peak") is not None:
            out.append(f"- rollout{how} at LLaDA-8B ({ours['rollouts']} rollouts): {ours['rollout_peak']:.1%} of bf16 peak "
                       f"(target >= 55 %): {'met' if ours['rollout_peak'] >= 0.55 else 'not met'}")
        sdar = find(shape="sdar", part="rl", compile=compiled)
        if sdar and sdar.get("train_mfu") is not None:
            out.append(f"- SDAR-8B RL training pass{how} (scoring + forward/backward): MFU {sdar['train_mfu']:.1%} "
                       f"(target >= 40 %): {'met' if sdar['train_mfu'] >= 0.40 else 'not met'}")
    for r in rows:
        for key, what in (("startup_s", "start-up"), ("export_s", "export")):
            if r.get(key) is not None and r[key] > 30:
                out.append(f"- {what} of {SHAPES[r['shape']]} ({r['part']}, {r.get('packing') or r.get('recipe')}): "
                           f"{r[key]:.1f} s (target <= 30 s): not met")
    return out or ["- nothing to compare in this run"]


def setup_lines(s: Settings, args, runs: list[dict]) -> list[str]:
    folder_rows = [r for r in runs if r.get("part") == "folder" and "error" not in r]
    made = "; ".join(f"{SHAPES[r['shape']]}: {r['params'] / 1e9:.3g} B parameters in {r['files']} shards, drawn in "
                     f"{r['init_s']:.1f} s, saved in {r['save_s']:.1f} s" for r in folder_rows)
    return [
        "- Model folders: the real config.json of bench/configs, random bf16 weights drawn on the device, written by "
        "`save_model` with the reference index's parameter names (checked), loaded by each stage through `model.path`"
        + (f" ({made})" if made else "") + ("; page cache dropped before every run (cold reads)" if args.cold else "") + ".",
        f"- SFT: {s.sft_micro} sequences per micro-batch x {s.sft_accum} accumulated = {s.sft_micro * s.sft_accum} per step, "
        f"real lengths uniform in [{s.sft_min_len}, {s.sft_max_len}] (LLaDA: prompt + the {s.sft_pad_to}-token canvas; SDAR: "
        f"prompt + response + EOS), {s.sft_warmup} warm-up step then {s.sft_steps} timed; LoRA r {s.sft_lora[0]}, alpha "
        f"{s.sft_lora[1]}, gradient checkpointing. tokens/s counts real tokens; MFU = model FLOPs (bench/model_throughput.py: "
        f"6 x non-embedding parameters per real token + attention; SDAR's two-stream layout counts each token twice) / time / "
        f"peak bf16. With LoRA the backward skips the frozen weights' gradients (-2N) while checkpointing recomputes the "
        f"forward (+2N), so 6N is also about what the GPU executes. Packed: `model.packing: on`; padded: `off`; + compile: `model.compile: true` as well (the first step compiles; from commit 852f02c Inductor rounds to bf16 where eager does, before it the loss drifted ~3 % from eager's).",
        f"- RL: d1, {s.rl_prompts} prompts x {s.rl_group} rollouts (prompts {s.rl_prompt_min}-{s.rl_prompt_max} tokens), gen "
        f"{s.rl_gen}, {s.rl_denoise_steps} denoising steps, block {s.rl_block} (SDAR: its block of 4), temperature "
        f"{s.rl_temperature}, {s.rl_iterations} inner iterations, micro-batches of {s.rl_micro}, KL {s.rl_kl} (reference = "
        f"adapter disabled), LoRA r {s.rl_lora[0]}, alpha {s.rl_lora[1]}, gradient checkpointing; reward: a hash of the "
        f"response tokens' text. DARE: dual cache (SDAR: block_kv), CUDA graphs on the GPU of forwards whose layers run through one torch.compile'd layer call (`compile_forward`; from commit 92d9a75, before it the whole forward was compiled per window shape), {s.rollout_batch} rollouts per batch, "
        f"packed training, step {s.rl_steps} shown. d1's own code: dllm-reasoning/d1's trainer methods (generate, "
        f"_get_per_token_logps, compute_loss; bench/peer_d1.py, the commit beside the row), {s.public_chunk} rollouts per "
        f"generate call and per-device batch as d1 sets them, the same LoRA, rollouts and inner iterations, step "
        f"{s.rl_public_steps} shown, its phases timed around d1's calls. Phase times come from the loops' metrics (`DARE_PHASE_TIMES`, GPU synchronised at "
        f"every phase boundary); 'other' is the rest of the step. Training pass MFU: the model FLOPs of the step's "
        f"scoring passes (2N a token: an old-policy forward per inner iteration after the first, whose old scores are the "
        f"update's own, and a reference forward per iteration) and update passes (6N a token, one per iteration), SDAR's "
        f"two streams counted twice, every rollout taken at the step's mean length (`sequence_tokens`; attention is "
        f"slightly undercounted), over the scoring and forward+backward seconds; + compile: `model.compile: true` as well. "
        f"Merged-LoRA rollouts: `rl.sampler.lora_merged: true`, the adapter folded into the weights while the rollouts "
        f"decode (docs/sampling.md#merged-lora-rollouts; rows without it decoded through the adapter). Rollout share of bf16 "
        f"peak: the model FLOPs of the forwards the sampler ran (`rollout_flops`: 2N per encoded token, every refresh of the "
        f"whole canvas included, the LM head per column whose logits were taken, QK^T + AV per attended pair) over the "
        f"rollout seconds and the GPU's dense bf16 peak."
        + (f" Logits-free scoring in the DARE runs: model.logits_chunk {s.rl_logits_chunk}." if s.rl_logits_chunk else "")
        + (" DARE's step and d1's ran at the same time, DARE's on GPU 0 and d1's on GPU 1 of one host (`--side-by-side`): "
           "the two share the host's CPUs and PCIe, not a GPU." if any(r.get("side_by_side") for r in runs) else ""),
    ]


def report(data: dict, s: Settings, args) -> str:
    rows = data["rows"]
    runs = data["runs"]
    tiny = " (--tiny: a shrunken model; the numbers check the script and measure nothing)" if args.tiny else ""
    lines = [f"# Training step on one GPU: the stage loops at the LLaDA-8B and SDAR-8B shapes{tiny}", ""]
    commits = list(dict.fromkeys(run["commit"] for run in runs))
    lines.append(f"Git commit: {', '.join(commits)}  ")
    for i, run in enumerate(runs):
        what = f"; rows: {', '.join(run['rows'])}" if run.get("rows") else ("; its rows were measured again later" if "rows" in run else "")
        lines.append(f"Command{f' (run {i})' if len(runs) > 1 else ''}: `{run['command']}` ({run['date']}, commit {run['commit']}{what})  ")
    machines = list(dict.fromkeys(run["hardware"] for run in runs if not run["hardware"].startswith("(no run finished)")))
    if len(machines) > 1:  # (a merged file: ratios are only taken within one run, on one machine)
        lines += [f"Hardware (runs {', '.join(str(i) for i, run in enumerate(runs) if run['hardware'] == m)}): {m}  " for m in machines]
    lines.append(f"Hardware: {runs[-1]['hardware']}  ")
    for gpus in dict.fromkeys(tuple(run["gpus"]) for run in runs if run.get("gpus")):
        on = [str(i) for i, run in enumerate(runs) if tuple(run.get("gpus") or ()) == gpus]
        lines.append(f"GPUs (run{'s' if len(on) > 1 else ''} {', '.join(on)}{', one after the other' if len(on) > 1 else ''}): "
                     f"{', '.join(gpus)}  ")
    lines.append(f"Libraries: {runs[-1].get('libraries', '(not recorded by these runs)')}")
    lines += [""] + setup_lines(s, args, rows) + [""]
    sft = [r for r in rows if r["part"] in ("sft", "sft-full")]
    rl = [r for r in rows if r["part"] in ("rl", "rl-d1", "rl-public")]
    folders = [r for r in rows if r["part"] == "folder" and "error" in r]
    for r in folders:
        lines.append(f"- {SHAPES[r['shape']]}: the model folder could not be written: {r['error']}")
    if sft:
        lines += ["## SFT: tokens/s, MFU and peak memory, packed vs padded", ""] + sft_table(sft) + [""]
    if rl:
        lines += ["## RL: one d1 step, DARE vs d1's own code (seconds)", ""] + rl_table(rl) + [""]
    engines = [r for r in rows if r["part"] == "rl-engines"]
    if engines:
        lines += ["## RL with lmdeploy rollouts: the same SDAR step by rollout engine (seconds)", "",
                  f"The d1 step above with the rollouts at {ENGINE_SAMPLER} (what lmdeploy honours exactly, both engines "
                  "alike; `unmasking: topk` is lmdeploy's `low_confidence_static`), one token per denoising step. lmdeploy runs "
                  "in its own process on the trainer's GPU (docs/sampling.md#engines); 'weight sync' is the push of the "
                  "policy's weights (LoRA merged) to it over CUDA IPC after the update, 0 for native, which decodes the "
                  "policy itself. lmdeploy starts during step 1 (not shown)."
                  + (" The two ran at the same time, native on GPU 0 and lmdeploy on GPU 1." if any(r.get("side_by_side") for r in engines) else ""),
                  ""] + engine_table(engines) + [""]
    if sft or rl:
        lines += ["## Start-up and export", ""] + startup_table(sft + [r for r in rl if r["recipe"] == "dare"]) + [""]
    lines += ["## Targets", ""] + acceptance(rows, runs) + [""]
    return "\n".join(lines)


def row_key(row: dict) -> tuple:
    """What a row measures: a later run of the same replaces it (--add)."""
    return row["part"], row["shape"], row.get("training"), row.get("packing"), row.get("compile"), row.get("recipe")


def merge_previous(path: Path, run: dict, keep: bool) -> dict:
    """The rows of earlier runs to keep (--add): same commit, machine (the same GPUs, where both runs
    name them) and settings only. Their ratios are then taken across the runs: one after the other
    on one machine, as the file's list of runs shows."""
    if not keep or not path.exists():
        return {"runs": [], "rows": []}
    old = json.loads(path.read_text())
    last = old["runs"][-1] if old.get("runs") else {}
    # compared as the file holds them: JSON has no tuples (the LoRA settings), which read back as lists
    same_gpus = not (last.get("gpus") and run.get("gpus")) or last["gpus"] == run["gpus"]
    if not same_gpus or any(last.get(k) != json.loads(json.dumps(run[k])) for k in ("commit", "hardware", "settings")):
        print(f"{path}: earlier rows are from another commit, machine or settings; not kept", flush=True)
        return {"runs": [], "rows": []}
    return old


def run_label(row: dict) -> str:
    return f"{row['part']} {SHAPES[row['shape']]}" + (f" {row['packing']}" if row.get("packing") else "") + \
        (" + compile" if row.get("compile") else "")


PEER_SETTINGS = ("public_chunk", "rl_public_steps")  # read only by the rows of d1's code (rl-d1, rl-public)
PEER_PARTS = ("rl-d1", "rl-public")


def _settings(run: dict) -> dict:
    """A run's settings with the fields added since it ran at their defaults (which it then used)."""
    return {**dataclasses.asdict(Settings()), **run["settings"]}


def _check_settings(merged: dict, paths: list[Path]) -> None:
    """Every run measured with the settings the report states (the last run's), except that the
    settings only d1's rows read need to agree only among the runs whose d1 rows are kept."""
    last = _settings(merged["runs"][-1])
    for i, run in enumerate(merged["runs"]):
        peer = any(r["part"] in PEER_PARTS and r.get("run") == i for r in merged["rows"])
        differ = {k for k, v in _settings(run).items() if v != last[k]} - (set() if peer else set(PEER_SETTINGS))
        if differ:
            raise SystemExit(f"{paths}: run {i} ({run['command']}) was measured with other settings ({sorted(differ)})")


def merge_files(paths: list[Path], out: Path, args) -> int:  # noqa: C901
    """One results file from several runs' JSON (runs of one settings, split to fit a time limit,
    possibly at different commits and machines): each run is listed with the rows it measured.
    `args.drop_parts`: rows of these parts are left out (superseded measurements)."""
    merged: dict = {"runs": [], "rows": []}
    for path in paths:
        data = json.loads(path.read_text())
        data["rows"] = [r for r in data["rows"] if r["part"] not in (args.drop_parts or ())]
        offset = len(merged["runs"])
        merged["runs"] += [dict(r) for r in data["runs"]]
        # a file written by an earlier merge credits each row to one of its runs already
        # (the rows of an --add file are one run's, its last, for their ratios; `measured_in` keeps which made each)
        rows = [{**r, "run": offset + r.get("run", len(data["runs"]) - 1),
                 **({"measured_in": offset + r["measured_in"]} if "measured_in" in r and "run" not in r else {})} for r in data["rows"]]
        if not args.keep_all:
            keys = {row_key(r) for r in rows}
            merged["rows"] = [r for r in merged["rows"] if row_key(r) not in keys]
        merged["rows"] += rows
    _check_settings(merged, paths)
    for i, run in enumerate(merged["runs"]):  # the rows of each run that the file shows
        run["rows"] = [run_label(r) for r in merged["rows"] if r.get("measured_in", r.get("run")) == i and r["part"] != "folder"]
    s = Settings(**merged["runs"][-1]["settings"])
    command = "python3 bench/train_step.py " + ("--keep-all " if args.keep_all else "") + \
        ("--drop-parts " + " ".join(args.drop_parts) + " " if args.drop_parts else "") + "--merge " + " ".join(shlex.quote(str(p)) for p in paths)
    text = report(merged, s, args).replace("Hardware:", f"Written from those runs' JSON files by `{command}`  \nHardware:", 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(merged, indent=1))
    print(text)
    return 0


