"""Token editing on the embedded task: LLaDA2.1's speed and quality modes, each with and without its
edits, on tiny LLaDA2-layout models trained from scratch by DARE's own stages, on a CPU: one by the
masked loss alone, one with the token-to-token stream (`sft.edit_noise`) that editing needs.

    python3 bench/editing_modes.py --out bench/results/editing_modes.md
    python3 bench/editing_modes.py --tiny --out tmp/editing_modes.md      # the CPU check of the script

`dare stage prepare` and `sft` train each model (settings over params.yaml below); then every
held-out problem is decoded greedily by DARE's loop with blocks of 8 and the block KV cache under
each mode (docs/sampling.md#token-editing): its commit threshold with its edit threshold and 16
post-edit steps, and the same commit threshold without editing. Reported: exact-answer accuracy,
denoising steps per generated token (each row's forwards over its tokens up to and including EOS)
and the share of rows whose answer editing changed.

`--rl-steps N` then trains the last model (the one with the largest edit_noise) with `dare stage rl`
for N steps of CJ-GRPO on rollouts that edit (`RL_SAMPLER`: sampled at temperature 1, quality
mode's thresholds, no cache, so the replay is exact; docs/algorithms.md#edited-rollouts), exports it
with `dare stage convert` and decodes the held-out problems with it as above.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dare_core.diffusion.seeding import sample_generators  # noqa: E402
from dare_core.models.hf_folder import load_model  # noqa: E402
from dare_core.models.tokenizer import load_tokenizer  # noqa: E402
from dare_core.rewards.arithmetic import arithmetic_reward  # noqa: E402
from dare_core.sampling.decode import generate, response_texts  # noqa: E402
from dare_core.sampling.params import EDITING_MODES, SamplingParams  # noqa: E402
from stamp import REPO, git_commit, hardware, library_versions, markdown_table, utc_now, write_atomic  # noqa: E402
from tiny_sdar import run_stage  # noqa: E402

RUN, BLOCK = "editing-modes", 8
# LLaDA2's from-scratch layout (llada2.tiny_config: 3 layers of width 128, 16 experts of which 4
# route a token beside a shared one) with blocks of 8: the answer's digits and EOS in one or two blocks
INIT = {"block_size": BLOCK, "max_position_embeddings": 64}
TINY_INIT = {**INIT, "hidden_size": 32, "head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
             "num_hidden_layers": 2, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 8,
             "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}
STEPS, TINY_STEPS = 1500, 5
# the RL rollouts: sampled, quality mode's thresholds with a few post-edit steps, no cache (CJ-GRPO
# replays the trajectory; a cache would make the behaviour policy differ slightly from the replay)
RL_SAMPLER = {"gen_length": BLOCK, "steps": BLOCK, "block_length": BLOCK, "temperature": 1.0, "unmasking": "threshold",
              "remasking": "maskgit_plus", "threshold": EDITING_MODES["quality"]["threshold"],
              "edit_threshold": EDITING_MODES["quality"]["edit_threshold"], "post_edit_steps": 4, "cache": "none"}


def rl_settings(steps: int, tiny: bool) -> list[str]:
    own = {"rl.algorithm": "cj_grpo", "rl.algorithm_args": {}, "rl.num_steps": steps, "rl.sampler": RL_SAMPLER,
           "rl.validate_every": 0, "rl.export": "last", "rl.save_every": max(1, steps)}
    if tiny:
        own.update({"rl.prompts_per_step": 4, "rl.group_size": 4})
    return [f"{k}={json.dumps(v)}" for k, v in own.items()]


def settings(workdir: Path, steps: int, tiny: bool, edit_noise: float) -> list[str]:
    own = {
        "run.name": f"{RUN}-{edit_noise}", "run.seed": 0, "run.runs_dir": str(workdir / "runs"), "run.models_dir": str(workdir / "models"),
        "run.metrics_dir": str(workdir / "metrics"), "run.artifact_root": None,
        "data.prepared_dir": str(workdir / "data" / "prepared"), "data.tokenizer_dir": str(workdir / "data" / "tokenizer"),
        "model.family": "llada2_moe", "model.init": TINY_INIT if tiny else INIT,
        "sft.pad_to": 5,  # block diffusion trains the response and its one EOS: 4 digits + EOS
        "sft.max_steps": steps, "sft.log_every": max(1, min(100, steps)), "sft.save_every": 10**9,
        "sft.edit_noise": edit_noise,
    }
    if tiny:
        own.update({"data.num_sft": 400, "data.num_rl": 64, "data.num_eval": 40, "data.num_preference": 64, "data.num_val": 16,
                    "sft.micro_batch_size": 16, "launch.threads": 1})
    return [f"{k}={json.dumps(v)}" for k, v in own.items()]


def decode_all(model, tokenizer, rows: list[dict], params: SamplingParams, batch: int) -> dict:
    """Accuracy, steps a generated token and the answers, every held-out row decoded under `params`."""
    answers, correct, steps, tokens = [], 0, 0, 0
    t0 = time.perf_counter()
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        prompts = [tokenizer.encode(r["prompt_text"]) for r in part]
        out = generate(model, prompts, params, sample_generators((0, "editing-modes"), [r["uid"] for r in part]))
        texts = response_texts(tokenizer, out.response)
        for row, text, n, k in zip(part, texts, out.lengths.tolist(), out.steps.tolist()):
            answers.append(text)
            correct += arithmetic_reward(text, row["ground_truth"]).score
            steps, tokens = steps + k, tokens + n
    return {"accuracy": correct / len(rows), "steps_per_token": steps / tokens, "answers": answers,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=str(REPO / "runs" / "bench-editing-modes"))
    p.add_argument("--steps", type=int, default=None, help=f"SFT steps (default {STEPS}; --tiny {TINY_STEPS})")
    p.add_argument("--tiny", action="store_true", help="a two-layer narrow model on a few hundred problems")
    p.add_argument("--batch", type=int, default=250)
    p.add_argument("--edit-noise", type=float, nargs="+", default=[0.0, 0.2],
                   help="one model per value of sft.edit_noise (0: the masked loss alone)")
    p.add_argument("--rl-steps", type=int, default=0, help="CJ-GRPO steps on edited rollouts for the last model (0: none)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    commit, started = git_commit(), utc_now()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    steps = args.steps if args.steps is not None else (TINY_STEPS if args.tiny else STEPS)
    import pyarrow.parquet as pq

    base = dict(gen_length=BLOCK, steps=BLOCK, block_length=BLOCK, cache="block_kv")
    results, cells, seconds, config = {}, [], {}, {}
    trained = [(q, f"{q}", "sft", workdir / "runs" / f"{RUN}-{q}" / "sft" / "model") for q in args.edit_noise]
    if args.rl_steps:
        q = args.edit_noise[-1]
        trained.append((q, f"{q} + {args.rl_steps} CJ-GRPO steps", "rl", workdir / "models" / f"{RUN}-{q}"))
    for q, label, stage, export in trained:
        sets = settings(workdir, steps, args.tiny, q)
        if stage == "sft":
            seconds[q] = {s: round(run_stage(s, sets, workdir / f"{s}-{q}.log"), 1) for s in ("prepare", "sft")}
        else:
            sets += rl_settings(args.rl_steps, args.tiny)
            seconds[label] = {s: round(run_stage(s, sets, workdir / f"{s}-{q}.log"), 1) for s in ("rl", "convert")}
        model, tokenizer = load_model(export).eval(), load_tokenizer(export)
        config = json.loads((export / "config.json").read_text())
        rows = pq.read_table(workdir / "data" / "prepared" / "eval.parquet").to_pylist()
        for mode in ("speed", "quality"):
            chosen = EDITING_MODES[mode]
            edited = decode_all(model, tokenizer, rows, SamplingParams(**base, **chosen), args.batch)
            plain = decode_all(model, tokenizer, rows, SamplingParams(**base, **{**chosen, "edit_threshold": None}), args.batch)
            changed = sum(a != b for a, b in zip(edited["answers"], plain["answers"])) / len(rows)
            for name, r in ((f"{mode}, editing", edited), (f"{mode}, no editing", plain)):
                results[f"edit_noise {label}: {name}"] = r
                cells.append([label, name, chosen["threshold"], chosen["edit_threshold"] if "no editing" not in name else "none",
                              f"{r['accuracy']:.3f}", f"{r['steps_per_token']:.3f}",
                              f"{changed:.3f}" if "no editing" not in name else "", f"{r['seconds']:.1f}"])
    command = "python3 bench/editing_modes.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    sft_times = ", ".join(f"{s['sft']:.0f} s" for s in seconds.values() if "sft" in s)
    rl_text = ""
    if args.rl_steps:
        rl_seconds = seconds[trained[-1][1]]["rl"]
        rl_text = (f" The last row's model is the edit_noise {trained[-1][0]} model after {args.rl_steps} RL steps "
                   f"of CJ-GRPO on rollouts that edit ({rl_seconds:.0f} s; `dare stage rl`, then `convert`): "
                   f"{json.dumps(RL_SAMPLER)} over params.yaml's RL settings; CJ-GRPO replays and scores every "
                   f"commit and edit (docs/algorithms.md#edited-rollouts).")
    text = "\n".join([
        "# Token editing on the embedded task: LLaDA2.1's speed and quality modes", "", f"Git commit: {commit}  ",
        f"Command: `{command}`  ", f"Hardware: {hardware(gpu=False, cpu_detail=True)}  ", f"Libraries: {library_versions()}  ",
        f"Date: {started}", "",
        f"Model: a LLaDA2-layout model ({config['num_hidden_layers']} layers of width {config['hidden_size']}, "
        f"{config['num_experts']} experts, blocks of {BLOCK}) trained from scratch by `dare stage sft` for {steps} steps "
        f"({sft_times}) on the arithmetic task over params.yaml's other "
        f"settings, one with each `sft.edit_noise` (the share of unmasked answer tokens replaced by random ones to be "
        f"corrected; 0: the masked loss alone). Decoding: each of the "
        f"{len(rows)} held-out problems greedily, blocks of {BLOCK}, the block KV cache, the mode's commit threshold with "
        f"its edit threshold and 16 post-edit steps, or without editing. Steps a token: a row's forwards over its tokens "
        f"up to and including EOS. Answers changed: rows whose answer differs from the same mode without editing.{rl_text}", "",
        *markdown_table(["sft.edit_noise", "decoding", "commit threshold", "edit threshold", "accuracy", "steps a token",
                         "answers changed", "seconds"], cells), ""])
    write_atomic(Path(args.out), text)
    write_atomic(Path(args.out).with_suffix(".json"), json.dumps(
        {"commit": commit, "command": command, "sft_steps": steps, "stage_seconds": {str(k): v for k, v in seconds.items()},
         "results": {k: {kk: vv for kk, vv in v.items() if kk != "answers"} for k, v in results.items()}}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
