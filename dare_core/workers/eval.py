"""Worker of the `eval` stage: held-out accuracy of the base, SFT and RL checkpoints."""
import json
import sys
from pathlib import Path

from dare_core.config import DareConfig
from dare_core.data.schema import read_rows
from dare_core.eval.quick import evaluate
from dare_core.eval.report import accuracy_plot
from dare_core.models.registry import load_model
from dare_core.models.tokenizer import load_tokenizer
from dare_core.storage import atomic_write_json, atomic_write_text
from dare_core.training.engine import device, resolve_dtype
from dare_core.workers.common import run_worker


def checkpoints(cfg: DareConfig) -> dict:
    """The checkpoints of the pipeline, in order: base (untrained or the given model), SFT, RL."""
    return {
        "base": Path(cfg.model.path) if cfg.model.path else cfg.base_model_dir,
        "sft": cfg.stage_dir("sft") / "model",
        "rl": cfg.final_model_dir,
    }


def run_eval(cfg: DareConfig) -> dict:
    data = Path(cfg.data.prepared_dir) / "eval.parquet"
    rows = read_rows(data, "eval")
    if cfg.eval.max_samples:
        rows = rows[: cfg.eval.max_samples]
    results, artifacts = {}, {}
    out_dir = cfg.stage_dir("eval")
    for name, folder in checkpoints(cfg).items():
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder}: checkpoint '{name}' not found (run the earlier stages first)")
        model = load_model(folder, dtype=resolve_dtype(cfg.model.dtype), device=device())
        res = evaluate(model, load_tokenizer(folder), rows, cfg.eval.sampler, cfg.eval.sampler.batch_size, cfg.run.seed, desc=f"eval[{name}]")
        preds = res.pop("predictions")
        atomic_write_text(out_dir / f"predictions_{name}.jsonl", "".join(json.dumps(p) + "\n" for p in preds))
        results[name] = {k: res[k] for k in ("accuracy", "mean_reward", "num_samples")}
        artifacts[name] = str(folder)
    # checkpoint order (base, sft, rl) is meaningful: keep it in the file
    atomic_write_json(Path(cfg.run.metrics_dir) / "eval.json", {**results, "artifacts": artifacts}, sort_keys=False)
    accuracy_plot(results, out_dir / "accuracy.png")
    for name, r in results.items():
        print(f"{name:>6}: accuracy {r['accuracy']:.3f} on {r['num_samples']} held-out problems ({artifacts[name]})")
    return results


def main(argv=None) -> int:
    return run_worker(run_eval, argv, "DARE eval stage")


if __name__ == "__main__":
    sys.exit(main())
