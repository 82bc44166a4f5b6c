"""Worker of the `eval` stage: OpenCompass on the pipeline's checkpoints.

Writes `metrics/eval.json` = {checkpoint: {benchmark: accuracy (0-100)}, "artifacts": {...}} (DVC
metrics, so `dvc metrics diff` compares experiments), and under runs/<name>/eval the OpenCompass
run (predictions, per-benchmark results, its summary), `summary.md`, `manifest.json` and
`accuracy.png`. The embedded default's benchmark is `task`: its own prepared eval split.

A failing run changes nothing: every input is checked before OpenCompass starts, runs/<name>/eval
is written as a temporary folder renamed into place when complete, and eval.json only after that.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dare_core.config import DareConfig
from dare_core.data.lengths import resolve as resolve_lengths
from dare_core.errors import UserError
from dare_core.inputs import model_folder
from dare_core.ownership import stage_off_note
from dare_core.storage import atomic_write_json, atomic_write_text
from dare_core.process.threads import log_threads
from dare_core.workers.common import run_worker

# what this stage writes into runs/<name>/eval (an unmarked folder holding only these is an earlier
# version's: ownership.py)
EVAL_WRITES = ("opencompass/*", "summary.md", "opencompass_summary.md", "manifest.json", "accuracy.png")


def model_options(cfg: DareConfig) -> dict:
    return {"sampler": cfg.eval.sampler.decoding_settings(), "seed": cfg.run.seed, "dtype": cfg.model.dtype, "chat": cfg.eval.chat,
            "ll_mc_num": cfg.eval.ll_mc_num, "engine": cfg.eval.sampler.engine, "engine_args": cfg.eval.sampler.engine_args}


def run_eval(cfg: DareConfig) -> dict:
    cfg = resolve_lengths(cfg)  # `auto` eval.sampler lengths, as the prepare stage derived them
    from dare_core.eval.report import accuracy_plot, results_table
    from dare_core.eval.runner import benchmark_specs, check_models, complete_or_absent, evaluate_folders

    everything = cfg.checkpoint_dirs
    folders = {name: everything[name] for name in cfg.eval.checkpoints}
    if "base" in folders and cfg.model.path:
        folders["base"] = model_folder(cfg)  # a URL: fetched (verified) into the download cache
    for name, folder in folders.items():
        note = stage_off_note(folder)
        if note:
            raise UserError(f"eval.checkpoints lists '{name}', but the {name} stage was off ({note}): take it out "
                            f"of eval.checkpoints, or switch the stage on")
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder}: checkpoint '{name}' not found (run the earlier stages first)")
    prepared = Path(cfg.data.prepared_dir) / "eval.parquet"
    specs = benchmark_specs(cfg.eval.benchmarks, Path(cfg.eval.data_dir) if cfg.eval.data_dir else None,
                            cfg.eval.benchmark_args, cfg.eval.max_samples or 0, data_dirs={"task": prepared})
    check_models(folders, specs, model_options(cfg))  # before the old results are touched
    log_threads()
    with complete_or_absent(cfg.stage_dir("eval"), EVAL_WRITES) as out_dir:
        results = evaluate_folders(folders, specs, out_dir / "opencompass", model_options(cfg), cfg.eval.sampler.batch_size,
                                   run_name="run", check=False)
        run_dir = out_dir / "opencompass" / "run"
        table = results_table(results)
        atomic_write_text(out_dir / "summary.md", table + "\n")
        for name, copy in (("summary.md", "opencompass_summary.md"), ("manifest.json", "manifest.json")):
            if (run_dir / name).exists():
                atomic_write_text(out_dir / copy, (run_dir / name).read_text())
        accuracy_plot(results, out_dir / "accuracy.png")
    # checkpoint order (base, sft, rl) is meaningful: keep it in the file
    atomic_write_json(Path(cfg.run.metrics_dir) / "eval.json",
                      {**results, "artifacts": {k: str(v) for k, v in folders.items()}}, sort_keys=False)
    print(table)
    return results


def main(argv=None) -> int:
    return run_worker(run_eval, argv, "DARE eval stage")


if __name__ == "__main__":
    sys.exit(main())
