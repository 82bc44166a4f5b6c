"""The results of bench/eval_engines.py: per-sampler agreement of the two engines, the verdict on whether
they score the same (both from the rows alone), and the results file with its JSON."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from stamp import REPO, fmt, header, markdown_table, write_atomic


def compare(rows: list[dict], tolerance: float) -> list[dict]:
    """Per sampler measured by both engines: identical answers, the score difference, the discordant items."""
    done = {(r["engine"], r["sampler"]): r for r in rows if "error" not in r}
    out = []
    for name in dict.fromkeys(r["sampler"] for r in rows):
        native, other = done.get(("native", name)), done.get(("lmdeploy", name))
        if native is None or other is None:
            continue
        if len(native["predictions"]) != len(other["predictions"]):
            raise ValueError(f"{name}: {len(native['predictions'])} native and {len(other['predictions'])} lmdeploy items")
        same = [a.strip() == b.strip() for a, b in zip(native["predictions"], other["predictions"])]
        diff = other["accuracy"] - native["accuracy"]
        out.append({"sampler": name, "items": len(same), "agreement": sum(same) / len(same), "different_answers": len(same) - sum(same),
                    "native_accuracy": native["accuracy"], "lmdeploy_accuracy": other["accuracy"], "difference": diff,
                    "only_native_right": sum(a > b for a, b in zip(native["scores"], other["scores"])),
                    "only_lmdeploy_right": sum(b > a for a, b in zip(native["scores"], other["scores"])),
                    "same_score": abs(diff) <= tolerance + 1e-12})
    return out


def verdict(rows: list[dict], comparisons: list[dict], tolerance: float) -> dict:
    """{verdict: same | different | not measured, reason}, from the rows alone."""
    wanted = list(dict.fromkeys(r["sampler"] for r in rows))
    if not comparisons:
        why = next((r["error"] for r in rows if r["engine"] == "lmdeploy" and "error" in r), None)
        why = why or next((f"native {r['sampler']}: {r['error']}" for r in rows if "error" in r), "no lmdeploy row ran")
        return {"verdict": "not measured", "reason": f"no sampler was measured by both engines: {why}"}
    tol = f"{tolerance:.1%}"
    bad = [c for c in comparisons if not c["same_score"]]
    missing = [s for s in wanted if s not in {c["sampler"] for c in comparisons}]
    parts = [f"{c['sampler']}: {c['difference']:+.1%} ({c['different_answers']} of {c['items']} answers differ)" for c in comparisons]
    if bad:
        return {"verdict": "different", "reason": f"|lmdeploy - native| > {tol} for {', '.join(c['sampler'] for c in bad)}; "
                + "; ".join(parts)}
    if missing:
        return {"verdict": "not measured", "reason": f"within {tol} where measured ({'; '.join(parts)}), but "
                f"{', '.join(missing)} was not measured by both engines"}
    return {"verdict": "same", "reason": f"every sampler's accuracy within {tol}: " + "; ".join(parts)}


def shown(path: Path) -> str:
    """A path as the results show it: from the checkout's root when inside it (the same on every machine)."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def table_cell(text: str, limit: int = 400) -> str:
    """An error message as one markdown cell (the JSON and the log keep it whole)."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit] + " ..."


def write_results(args, rows: list[dict], status: str) -> None:
    """The results file and its JSON, whole (rows as measured so far, the comparisons and verdict from them)."""
    comparisons = compare(rows, args.tolerance)
    decided = verdict(rows, comparisons, args.tolerance)
    rule = {"static": "topk", "threshold": f"threshold {args.threshold:g}"}
    cells = [[r["engine"], f"{r['sampler']} ({rule[r['sampler']]})", r["items"], fmt(r.get("accuracy"), ".3f"),
              r.get("correct", ""), fmt(r.get("wall_s"), ".2f"), fmt(r.get("start_s"), ".2f"), table_cell(r.get("error", ""))]
             for r in rows]
    agree = [[c["sampler"], c["items"], f"{c['agreement']:.3f}", c["different_answers"], f"{c['native_accuracy']:.3f}",
              f"{c['lmdeploy_accuracy']:.3f}", f"{c['difference']:+.3f}", c["only_native_right"], c["only_lmdeploy_right"],
              "yes" if c["same_score"] else "no"] for c in comparisons]
    lines = header("Evaluation through native and lmdeploy: task scores of an SDAR folder", args.command, args.hardware,
                   args.commit, args.libraries, args.date)
    lines += [f"- Model: `{shown(args.model)}` ({args.model_line}).", f"- Items: {args.items_line}.",
              "- Scoring: no OpenCompass on this path (the GPU machine has none). `EvalModel` (the class OpenCompass's "
              "DareModel wraps; `engine`/`engine_args` as the eval stage passes `eval.sampler.engine`) decodes the "
              "benchmark's prompts as prepared, and the `task` benchmark's grader (what DareEvaluator calls) scores them.",
              f"- Samplers: static = one token per step (`unmasking: topk`, steps = gen length), threshold = `unmasking: "
              f"threshold`, {args.threshold}; both greedy (temperature 0), `remasking: low_confidence`, block "
              f"{args.block}, gen length {args.gen_length}, `cache: block_kv`, stop at EOS. dtype {args.dtype}, "
              f"{args.device}, batch {args.batch_size}; lmdeploy engine_args {json.dumps(args.lmdeploy_args)} "
              f"(+ max_batch_size, dtype).",
              "- wall s: the timed pass over every item; start s: building the EvalModel and a warm-up pass over the "
              "first batch (lmdeploy's engine start, native's CUDA-graph capture).",
              f"- Same scores: |lmdeploy accuracy - native accuracy| <= {args.tolerance:.1%} per sampler (tolerance "
              f"`--tolerance {args.tolerance:g}`): the engines run different kernels, so a greedy pick may flip where two "
              "logits are within rounding; the agreement and discordant items show how many did.",
              f"- Status: {status}."]
    if args.errors_logged:
        lines.append(f"- Tracebacks of the errors: `{args.log.name}` beside this file.")
    lines += ["", "## Rows", ""]
    lines += markdown_table(["engine", "sampler", "items", "accuracy", "correct", "wall s", "start s", "error"], cells)
    for r in rows:  # lmdeploy runs in its own environment: its versions are what its engine reports
        if r.get("engine_info"):
            lines += ["", f"The {r['engine']} engine ({r['sampler']}) reported: `{json.dumps(r['engine_info'], default=str)}`"]
    lines += ["", "## Agreement", "", "Identical answers: the engines' response texts, stripped, are equal (the arithmetic "
              "grader reads the whole response as the answer). Only native / only lmdeploy right: items one engine "
              "answered correctly and the other did not.", ""]
    lines += (markdown_table(["sampler", "items", "identical answers", "answers differing", "native accuracy", "lmdeploy accuracy",
                              "lmdeploy - native", "only native right", "only lmdeploy right", "same score"], agree)
              if agree else ["No sampler was measured by both engines."])
    lines += ["", "## Verdict", "", f"**{decided['verdict']}**: {decided['reason']}.", ""]
    write_atomic(args.out, "\n".join(lines))
    saved = {k: getattr(args, k) for k in ("commit", "command", "hardware", "libraries", "date", "tolerance", "dtype", "device",
                                            "batch_size", "gen_length", "threshold", "lmdeploy_args")}
    saved.update(model=shown(args.model), data=shown(args.data), status=status, rows=rows, comparisons=comparisons, verdict=decided,
                 training=args.training)
    write_atomic(args.out.with_suffix(".json"), json.dumps(saved, indent=1, default=str) + "\n")


def describe_model(model, training: Optional[dict]) -> str:
    """The model in one line: its shape, and how it was trained when the folder says (training.json)."""
    cfg = model.hf_config
    line = (f"{cfg.get('model_type')}, {cfg.get('num_hidden_layers')} layers, width {cfg.get('hidden_size')}, "
            f"{cfg.get('num_attention_heads')} heads of {cfg.get('head_dim')} ({cfg.get('num_key_value_heads')} key/value), "
            f"vocabulary {cfg.get('vocab_size')}, mask id {cfg.get('mask_token_id')}, block {model.block_size}, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters")
    if training:
        oc = ", ".join(f"{k} {v:.3f}" for k, v in (training.get("opencompass_accuracy") or {}).items()) or "not run"
        line += (f"; trained by bench/tiny_sdar.py at {training.get('commit')}: {training.get('sft_steps')} SFT steps in "
                 f"{training.get('sft_seconds')} s on {training.get('hardware')}; its eval stage's OpenCompass score "
                 f"there ({training.get('eval_items')} items, the eval sampler of its training.json): {oc}")
    return line
