"""Run OpenCompass on checkpoint folders and benchmarks; return one number per (model, benchmark).

The config is plain data (classes by dotted path), written without importing OpenCompass. The run
is a subprocess (`python -m opencompass.cli.main <config> --debug`): OpenCompass's logging,
registries and argv stay out of the caller, and in debug mode all of its tasks run in that one
process, so a checkpoint is loaded once for every benchmark. Predictions are written per
benchmark as they finish; rerunning into the same run folder reuses them (`reuse=True`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from dare_core.eval.configs import get_benchmark, parse_benchmarks
from dare_core.storage import atomic_write_text


# the OpenCompass classes, by dotted path: this module never imports OpenCompass itself (its import
# rewires logging and stdio of the process that does it), so configs are plain data
GLUE = "dare_core.eval.opencompass"


class EvalRunError(RuntimeError):
    """OpenCompass failed; the message carries the tail of its log."""


@dataclass
class BenchmarkSpec:
    """A benchmark as one run evaluates it: mode, few-shot count, sample cap, sampler settings."""

    name: str
    mode: str = "gen"
    shots: int = 0
    max_samples: int = 0
    sampler: dict = field(default_factory=dict)
    data_dir: Optional[Path] = None

    @classmethod
    def from_args(cls, name: str, args: Optional[dict] = None, max_samples: int = 0) -> "BenchmarkSpec":
        args = dict(args or {})
        unknown = set(args) - {"mode", "shots", "max_samples", "sampler"}
        if unknown:
            raise ValueError(f"eval.benchmark_args.{name}: unknown keys {sorted(unknown)} (mode, shots, max_samples, sampler)")
        return cls(name, args.get("mode", "gen"), int(args.get("shots", 0)), int(args.get("max_samples", max_samples) or 0),
                   dict(args.get("sampler") or {}))


def report_name(spec: BenchmarkSpec) -> str:
    """The key a benchmark's score is reported under (the synthetic task's own name for `task`)."""
    base = get_benchmark(spec.name).report_name(spec.data_dir)
    return base if spec.mode == "gen" else f"{base}_{spec.mode}"


def dataset_config(benchmark: str, data_dir: str | Path, mode: str = "gen", sampler: Optional[dict] = None,
                   options: Optional[dict] = None, abbr: Optional[str] = None) -> dict:
    """One OpenCompass dataset entry for `benchmark` (a name in `dare_core.eval.configs`)."""
    bench = get_benchmark(benchmark)
    if mode not in bench.modes:
        raise ValueError(f"{benchmark}: mode '{mode}' not available (modes: {list(bench.modes)})")
    field = "context" if mode == "ll" else "question"
    template = {"round": [{"role": "HUMAN", "prompt": "{" + field + "}"}]} if bench.chat else "{" + field + "}"
    columns = [field] + (["choices", "labels"] if mode == "ll" else [])
    settings = {**bench.gen, **(sampler or {})}
    if mode == "ll":
        inferencer = {"type": f"{GLUE}.ELBOChoiceInferencer"}
    else:
        inferencer = {"type": f"{GLUE}.DiffusionGenInferencer", "max_out_len": int(settings.get("gen_length", 0)) or None,
                      "sampler": settings}
        if inferencer["max_out_len"] is None:
            del inferencer["max_out_len"]
    return {
        "abbr": abbr or benchmark,
        "type": f"{GLUE}.DareDataset",
        "path": str(data_dir),
        "benchmark": benchmark,
        "options": dict(options or {}),
        "reader_cfg": {"input_columns": columns, "output_column": "answer"},
        "infer_cfg": {
            "prompt_template": {"type": "opencompass.openicl.icl_prompt_template.PromptTemplate", "template": template},
            "retriever": {"type": "opencompass.openicl.icl_retriever.ZeroRetriever"},
            "inferencer": inferencer,
        },
        "eval_cfg": {"evaluator": {"type": f"{GLUE}.DareEvaluator", "benchmark": benchmark, "mode": mode}},
    }


def model_config(abbr: str, folder: str | Path, batch_size: int = 16, model_class: Optional[str] = None, **options: Any) -> dict:
    """One OpenCompass model entry: `folder` is a DARE/Hugging Face checkpoint folder (DareModel
    becomes its family's class), unless `model_class` (a dotted path) names another class."""
    cls = model_class or f"{GLUE}.DareModel"
    # OpenCompass pops `batch_size` (prompts per call) before building the model; the model's own
    # decode batch travels as `decode_batch_size`
    return {"abbr": abbr, "type": cls, "path": str(folder), "batch_size": batch_size, "decode_batch_size": batch_size,
            "run_cfg": {"num_gpus": 0}, **options}


def opencompass_config(models: dict, specs: list, work_dir: Path, model_options: Optional[dict] = None,
                       batch_size: int = 16) -> dict:
    """The OpenCompass config (plain data: classes by dotted path) for `models` {abbr: folder}."""
    datasets = []
    for spec in specs:
        options = {"shots": spec.shots} if spec.shots else {}
        if spec.max_samples:
            options["max_samples"] = spec.max_samples
        datasets.append(dataset_config(spec.name, spec.data_dir, spec.mode, spec.sampler, options, abbr=report_name(spec)))
    # a model is a checkpoint folder, or a dict of model_config arguments (another model class)
    model_cfgs = [model_config(abbr, **{**(model_options or {}), **spec}, batch_size=batch_size) if isinstance(spec, dict)
                  else model_config(abbr, spec, batch_size=batch_size, **(model_options or {})) for abbr, spec in models.items()]
    # one task per model holding every benchmark, run in one process: each checkpoint loads once
    partitioner = {"type": "opencompass.partitioners.NaivePartitioner", "n": max(len(datasets), 1)}
    runner = {"type": "opencompass.runners.LocalRunner", "max_num_workers": 1}
    return {
        "models": model_cfgs,
        "datasets": datasets,
        "work_dir": str(work_dir),
        "infer": {"partitioner": partitioner, "runner": {**runner, "task": {"type": "opencompass.tasks.OpenICLInferTask"}}},
        "eval": {"partitioner": partitioner, "runner": {**runner, "task": {"type": "opencompass.tasks.OpenICLEvalTask"}}},
    }


def write_config(config: dict, path: Path) -> Path:
    """An OpenCompass (mmengine) config file: one assignment per top-level key, values as literals."""
    atomic_write_text(path, "# written by dare_core.eval.runner\n" + "".join(f"{key} = {value!r}\n" for key, value in config.items()))
    return path


def run_opencompass(config: dict, work_dir: Path, run_name: str = "run", reuse: bool = False,
                    env: Optional[dict] = None, quiet: bool = False) -> dict:
    """Run OpenCompass on `config`; return {model_abbr: {dataset_abbr: accuracy}} and copy its
    summary to `<work_dir>/<run_name>/summary.{md,csv,txt}`."""
    work_dir = Path(work_dir)
    run_dir = work_dir / run_name
    if run_dir.exists() and not reuse:
        shutil.rmtree(run_dir)
    cfg_path = write_config({**config, "work_dir": str(work_dir)}, work_dir / f"{run_name}_config.py")
    cmd = [sys.executable, "-m", "opencompass.cli.main", str(cfg_path), "--debug", "-w", str(work_dir), "-r", run_name]
    run_env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    log_path = work_dir / f"{run_name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env, bufsize=1)
        for line in proc.stdout:  # type: ignore[union-attr]
            log.write(line)
            if not quiet and _worth_showing(line):
                sys.stderr.write(line)
        rc = proc.wait()
    if rc != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise EvalRunError(f"OpenCompass failed (exit {rc}); full log: {log_path}\n{tail}")
    results = collect_results(run_dir, config)
    _copy_summary(run_dir)
    return results


def _worth_showing(line: str) -> bool:
    # OpenCompass's debug log is very chatty; progress bars, warnings and errors are what a user needs
    if line.startswith("Map"):  # datasets' own progress bar over a handful of rows
        return False
    return ("it/s]" in line or "s/it]" in line or "%|" in line or "ERROR" in line or "Traceback" in line
            or "Error" in line or "WARNING" in line)


def collect_results(run_dir: Path, config: dict) -> dict:
    out: dict = {}
    for model in config["models"]:
        scores = {}
        for ds in config["datasets"]:
            path = run_dir / "results" / model["abbr"] / f"{ds['abbr']}.json"
            if not path.exists():
                raise EvalRunError(f"OpenCompass wrote no result for {model['abbr']} on {ds['abbr']} ({path})")
            result = json.loads(path.read_text())
            if "error" in result:
                raise EvalRunError(f"{model['abbr']} on {ds['abbr']}: {result['error']}")
            scores[ds["abbr"]] = round(float(result["accuracy"]), 4)
        out[model["abbr"]] = scores
    return out


def _copy_summary(run_dir: Path) -> None:
    summaries = sorted((run_dir / "summary").glob("summary_*.md"))
    if not summaries:
        return
    latest = summaries[-1]
    for suffix in (".md", ".csv", ".txt"):
        src = latest.with_suffix(suffix)
        if src.exists():
            shutil.copyfile(src, run_dir / f"summary{suffix}")


def benchmark_specs(benchmarks, data_dir: Optional[Path], benchmark_args: Optional[dict] = None, max_samples: int = 0,
                    data_dirs: Optional[dict] = None) -> list:
    """Validated specs, each with its data folder; every file is checked before any model loads."""
    specs = []
    for name in parse_benchmarks(benchmarks):
        spec = BenchmarkSpec.from_args(name, (benchmark_args or {}).get(name), max_samples)
        folder = (data_dirs or {}).get(name, data_dir)
        bench = get_benchmark(name)
        if folder is None:
            raise ValueError(f"{name}: no data folder given (eval.data_dir / --data); expected layout: {bench.layout}")
        spec.data_dir = Path(folder)
        if spec.mode not in bench.modes:
            raise ValueError(f"{name}: mode '{spec.mode}' not available (modes: {list(bench.modes)})")
        bench.load(spec.data_dir, max_samples=1)
        specs.append(spec)
    return specs


def evaluate_folders(models: dict, specs: list, work_dir: Path, model_options: Optional[dict] = None, batch_size: int = 16,
                     run_name: str = "run", reuse: bool = False, env: Optional[dict] = None, quiet: bool = False) -> dict:
    """The whole path: specs -> OpenCompass config -> run -> {model: {benchmark: score}}."""
    config = opencompass_config(models, specs, Path(work_dir), model_options, batch_size)
    return run_opencompass(config, Path(work_dir), run_name, reuse, env, quiet)


def run_manifest(models: dict, specs: list, model_options: Optional[dict], batch_size: int) -> dict:
    """What the numbers depend on (ALGORITHMS.md 8): checkpoints, settings per benchmark, software,
    hardware. Written next to every evaluation's results."""
    from dare_core.eval.lm import environment

    return {
        "checkpoints": {k: str(v) for k, v in models.items()},
        "benchmarks": [{**asdict(s), "data_dir": str(s.data_dir),
                        "gen": {**get_benchmark(s.name).gen, **s.sampler}} for s in specs],
        "model_options": model_options or {},
        "batch_size": batch_size,
        **environment(),
    }
