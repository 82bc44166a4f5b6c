"""Run OpenCompass on checkpoint folders and benchmarks; return one number per (model, benchmark).

The config is plain data (classes by dotted path), written without importing OpenCompass. The run
is a subprocess (`python -m opencompass.cli.main <config> --debug`): OpenCompass's logging,
registries and argv stay out of the caller, and in debug mode all of its OpenCompass tasks run in that one
process, so a checkpoint is loaded once for every benchmark. Predictions are written per
benchmark as they finish; rerunning into the same run folder reuses them (`reuse=True`).

Nothing partial is left behind: every model folder and sampler setting is checked before OpenCompass
starts, and a run is written into a temporary sibling of its folder, renamed into place only once
it is complete. When OpenCompass fails, the error names the exception it raised (from its log).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

from dare_core.errors import UserError
from dare_core.eval.configs import get_benchmark, parse_benchmarks
from dare_core.process.exits import is_progress_bar, killed_by, signal_of
from dare_core.storage import atomic_dir, atomic_write_json, atomic_write_text
from dare_core.process.lifeline import dies_with_parent


# the OpenCompass classes, by dotted path: this module never imports OpenCompass itself (its import
# rewires logging and stdio of the process that does it), so configs are plain data
GLUE = "dare_core.eval.opencompass"


class EvalRunError(UserError):
    """OpenCompass failed; the message carries the error it reported (its log names the cause:
    a benchmark file, a prompt too long, memory), so it is printed as one line."""


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
    # one OpenCompass task per model holding every benchmark, run in one process: each checkpoint loads once
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


@contextlib.contextmanager
def complete_or_absent(path: Path, writes: Iterable[str] = ()) -> Iterator[Path]:
    """`storage.atomic_dir(path, writes)`: a temporary sibling renamed to `path` on success; on failure
    it is removed, and so are the parent folders it had to create (a failed run leaves nothing)."""
    path = Path(path)
    created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    try:
        with atomic_dir(path, writes=writes) as tmp:
            yield tmp
    except BaseException:
        for folder in created:  # innermost first; a folder someone else filled meanwhile stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def run_opencompass(config: dict, work_dir: Path, run_name: str = "run", reuse: bool = False,
                    env: Optional[dict] = None, quiet: bool = False, extra_files: Optional[dict] = None) -> dict:
    """Run OpenCompass on `config`; return {model_abbr: {dataset_abbr: accuracy}}. The run folder
    `<work_dir>/<run_name>` (predictions, results, OpenCompass's config and log, its summary copied
    to `summary.{md,csv,txt}`, and `extra_files` {name: JSON object}) appears complete or not at all."""
    work_dir = Path(work_dir)
    run_dir = work_dir / run_name
    with complete_or_absent(run_dir) as tmp:
        if reuse and run_dir.is_dir():
            shutil.copytree(run_dir, tmp, dirs_exist_ok=True)
        cfg_path = write_config({**config, "work_dir": str(work_dir)}, tmp / "opencompass_config.py")
        # OpenCompass writes into <-w>/<-r>: the temporary folder itself
        cmd = [sys.executable, "-m", "opencompass.cli.main", str(cfg_path), "--debug", "-w", str(work_dir), "-r", tmp.name]
        run_env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        log_path = tmp / "opencompass.log"
        rc = _run_logged(cmd, run_env, log_path, quiet)
        if rc != 0:
            raise EvalRunError(_failure(log_path, rc))
        results = collect_results(tmp, config)
        _copy_summary(tmp)
        for name, obj in (extra_files or {}).items():
            atomic_write_json(tmp / name, obj, sort_keys=False)
    return results


def _run_logged(cmd: list, env: dict, log_path: Path, quiet: bool) -> int:
    with open(log_path, "w") as log:
        # it ends with the stage (or `dare eval`) that started it: a killed run leaves no evaluator on
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1,
                                preexec_fn=dies_with_parent())
        for line in proc.stdout:  # type: ignore[union-attr]
            log.write(line)
            if not quiet and _worth_showing(line):
                sys.stderr.write(line)
        return proc.wait()


def _worth_showing(line: str) -> bool:
    # OpenCompass's debug log is very chatty: progress bars are what a user watches; its warnings
    # stay in the log, and an error is reported once, as the failure's message
    if line.startswith("Map"):  # datasets' own progress bar over a handful of rows
        return False
    return is_progress_bar(line)


# the last line of a Python traceback: `ValueError: ...`, `dare_core.errors.ModelLoadError: ...`
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): (.+)$")


def _failure(log_path: Path, rc: int) -> str:
    """The error OpenCompass died of, for a one-line message; the log is kept outside the run folder
    (which is removed) so the whole story stays readable."""
    lines = log_path.read_text(errors="replace").splitlines()
    cause = next((f"{m.group(1)}: {m.group(2).strip()}" for m in map(_EXCEPTION_LINE.match, reversed(lines)) if m), None)
    if cause is None:
        died = signal_of(rc)
        cause = killed_by(died) if died else next(
            (line.strip() for line in reversed(lines) if line.strip() and not is_progress_bar(line)), "no output")
    fd, kept = tempfile.mkstemp(prefix="dare-opencompass-", suffix=".log")
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines) + "\n")
    return f"OpenCompass failed: {cause} (exit {rc}; full log: {kept})"


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


def benchmark_settings(benchmarks: str | Sequence[str], benchmark_args: Optional[dict] = None,
                       max_samples: int = 0) -> list[BenchmarkSpec]:
    """The specs of `benchmarks`, names, options and modes checked, no data folder read yet."""
    specs = []
    for name in parse_benchmarks(benchmarks):
        spec = BenchmarkSpec.from_args(name, (benchmark_args or {}).get(name), max_samples)
        modes = get_benchmark(name).modes
        if spec.mode not in modes:
            raise ValueError(f"{name}: mode '{spec.mode}' not available (modes: {list(modes)})")
        specs.append(spec)
    return specs


def benchmark_specs(benchmarks, data_dir: Optional[Path], benchmark_args: Optional[dict] = None, max_samples: int = 0,
                    data_dirs: Optional[dict] = None) -> list:
    """Validated specs, each with its data folder; every file is checked before any model loads."""
    specs = benchmark_settings(benchmarks, benchmark_args, max_samples)
    for spec in specs:
        folder = (data_dirs or {}).get(spec.name, data_dir)
        bench = get_benchmark(spec.name)
        if folder is None:
            raise ValueError(f"{spec.name}: no data folder given (eval.data_dir / --data); expected layout: {bench.layout}")
        spec.data_dir = Path(folder)
        bench.load(spec.data_dir, max_samples=1)
    return specs


def check_models(models: dict, specs: list, model_options: Optional[dict] = None) -> None:
    """Before OpenCompass starts: every checkpoint folder readable (config.json, shard headers,
    tokenizer), every benchmark's sampler settings valid for its family, and every prompt of a
    generating benchmark short enough for the model (the row is named)."""
    from dare_core.eval.lm import check_model_folder

    options = model_options or {}
    # what DiffusionGenInferencer applies on top of the model's settings (see dataset_config)
    gen_specs = [spec for spec in specs if spec.mode == "gen"]
    benchmarks = {spec.name: {**get_benchmark(spec.name).gen, **spec.sampler} for spec in gen_specs}
    for folder in models.values():
        if isinstance(folder, dict):  # another model class (model_config arguments): it checks itself
            continue
        found = check_model_folder(folder, options.get("sampler"), benchmarks)
        for spec in gen_specs:
            _check_prompt_lengths(folder, spec, found, chat=options.get("chat", True))


def _check_prompt_lengths(folder: Path, spec: BenchmarkSpec, found: Any, chat: bool) -> None:
    from dare_core.eval.lm import check_prompt_length

    bench = get_benchmark(spec.name)
    load_options = {"shots": spec.shots} if spec.shots else {}
    if spec.max_samples:
        load_options["max_samples"] = spec.max_samples
    gen_length = found.settings[spec.name].gen_length
    for row in bench.load(spec.data_dir, **load_options):
        # rendered as the model will see it (EvalModel.render of OpenCompass's one-turn prompt)
        text = row["question"]
        if bench.chat and chat:
            text = found.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        check_prompt_length(len(found.tokenizer.encode(text)), gen_length, found.model.max_sequence_length,
                            f"{folder}, benchmark {spec.name!r}, row {row.get('id')!r}: the prompt")


def evaluate_folders(models: dict, specs: list, work_dir: Path, model_options: Optional[dict] = None, batch_size: int = 16,
                     run_name: str = "run", reuse: bool = False, env: Optional[dict] = None, quiet: bool = False,
                     check: bool = True) -> dict:
    """The whole path: checks (`check_models`, unless the caller has just run them) -> OpenCompass
    config -> run -> {model: {benchmark: score}}; the run folder holds the manifest
    (`run_manifest`) next to OpenCompass's output."""
    if check:
        check_models(models, specs, model_options)
    config = opencompass_config(models, specs, Path(work_dir), model_options, batch_size)
    manifest = run_manifest(models, specs, model_options, batch_size)
    return run_opencompass(config, Path(work_dir), run_name, reuse, env, quiet, extra_files={"manifest.json": manifest})


def run_manifest(models: dict, specs: list, model_options: Optional[dict], batch_size: int) -> dict:
    """What the numbers depend on (docs/evaluation.md#reference-numbers): checkpoints, settings per benchmark, software,
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
