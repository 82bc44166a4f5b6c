"""OpenCompass glue: our families as OpenCompass models, our benchmarks as OpenCompass datasets.

- `DareModel` (one base for every family) wraps `EvalModel`: OpenCompass hands it prompts, it
  renders them with the checkpoint's chat template and decodes them with our sampler in batches.
  A family class only adds the sampler defaults its papers evaluate with; a config that names
  `DareModel` gets the class of the folder's config.json (`model_class_for`).
- Modes. `gen` (every benchmark): the model writes an answer and the benchmark's grader checks
  it (math by symbolic equivalence, code in the sandbox, options by the letter given).
  `ll` (multiple choice: MMLU, MMLU-Pro, HellaSwag, ARC-C, GPQA): `ELBOChoiceInferencer` scores
  every option's continuation by its ELBO log-likelihood (docs/diffusion.md#mc-elbo / docs/diffusion.md#per-block-elbo) and predicts
  the best. DARE's published table uses `gen` for all twelve; `ll` is the base-model protocol.
- Per-benchmark sampler settings travel in the dataset's inferencer config (`sampler`), so one
  model serves benchmarks with different gen lengths, steps, blocks, caches and thresholds.

This module imports OpenCompass; nothing else in dare_core does (GPU code uses `lm.py`, and the
config is written by `runner.py` without importing it: OpenCompass only ever runs in its own
process).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, List, Optional

from datasets import Dataset
from opencompass.datasets.base import BaseDataset
from opencompass.models.base import BaseModel
from opencompass.models.base_api import APITemplateParser
from opencompass.openicl.icl_evaluator import BaseEvaluator
from opencompass.openicl.icl_inferencer import GenInferencer
from opencompass.openicl.icl_inferencer.icl_base_inferencer import BaseInferencer
from opencompass.registry import ICL_EVALUATORS, ICL_INFERENCERS, LOAD_DATASET, MODELS

from dare_core.eval.configs import get_benchmark
from dare_core.eval.lm import load_eval_model
from dare_core.models.family import own_families
from dare_core.registry import Registry
from dare_core.storage import atomic_write_text, read_json

# model_type in config.json -> OpenCompass model class
FAMILY_CLASSES = Registry("OpenCompass model family")
_ROLES = {"HUMAN": "user", "BOT": "assistant", "SYSTEM": "system"}


def _messages(prompt: Any) -> Any:
    """OpenCompass's role list -> chat messages; plain strings stay raw text."""
    if isinstance(prompt, str):
        return prompt
    out: list = []
    for item in prompt:
        if isinstance(item, str):
            item = {"role": "HUMAN", "prompt": item}
        if not item.get("prompt"):
            continue
        role = _ROLES[item["role"]]
        if out and out[-1]["role"] == role:
            out[-1]["content"] += "\n" + item["prompt"]
        else:
            out.append({"role": role, "content": item["prompt"]})
    return out


def role_parser(meta_template: Optional[dict] = None) -> APITemplateParser:
    """A template parser that keeps role lists as lists, so the checkpoint's own chat template
    renders them (OpenCompass's plain LM parser would flatten them into one string)."""
    return APITemplateParser(meta_template or {"round": [
        {"role": "HUMAN", "api_role": "HUMAN"}, {"role": "SYSTEM", "api_role": "SYSTEM"},
        {"role": "BOT", "api_role": "BOT", "generate": True}]})


class DareModel(BaseModel):
    """Any DARE family under OpenCompass. `sampler`: settings for every benchmark (the eval
    stage's `eval.sampler`); `family_sampler` (per class) sits below the checkpoint's own
    `dare_sampler`, which sits below `sampler`."""

    family_sampler: dict = {}

    def __new__(cls, path: str = "", **_: Any):
        # configs name DareModel; the folder's config.json picks the family class
        if cls is DareModel:
            cls = model_class_for(path)
        return super().__new__(cls)

    def __init__(self, path: str, sampler: Optional[dict] = None, chat: bool = True, seed: int = 0, dtype: str = "auto",
                 decode_batch_size: int = 16, ll_mc_num: int = 32, ll_norm: str = "mean", engine: str = "native",
                 engine_args: Optional[dict] = None, max_seq_len: int = 1 << 20, meta_template: Optional[dict] = None,
                 progress: bool = False, **_: Any):
        super().__init__(path=path, max_seq_len=max_seq_len, meta_template=meta_template)
        self.template_parser = role_parser(meta_template)
        self.lm = load_eval_model(path, defaults=self.family_sampler, sampler=sampler, chat=chat, seed=seed,
                                  dtype=dtype, batch_size=decode_batch_size, ll_mc_num=ll_mc_num, ll_norm=ll_norm,
                                  engine=engine, engine_args=engine_args, progress=progress)
        self.tokenizer = self.lm.tokenizer
        self.overrides: dict = {}

    @contextlib.contextmanager
    def sampler_overrides(self, overrides: Optional[dict]):
        previous, self.overrides = self.overrides, dict(overrides or {})
        try:
            yield
        finally:
            self.overrides = previous

    def generate(self, inputs: List[Any], max_out_len: int, **_: Any) -> List[str]:
        # the benchmark's sampler settings carry its gen length; OpenCompass's max_out_len is a fallback
        overrides = {**({"gen_length": int(max_out_len)} if max_out_len else {}), **self.overrides}
        return self.lm.generate([_messages(p) for p in inputs], overrides)

    def loglikelihood(self, contexts: List[Any], continuations: List[str]) -> List[float]:
        return self.lm.loglikelihood([_messages(c) for c in contexts], continuations)

    def get_token_len(self, prompt: Any) -> int:
        return len(self.tokenizer.encode(self.lm.render(_messages(prompt))))

    def get_ppl(self, inputs: List[str], mask_length: Optional[List[int]] = None) -> List[float]:
        raise NotImplementedError("diffusion models have no left-to-right perplexity: use mode 'll' (ELBOChoiceInferencer)")


def _family_classes() -> list[str]:
    """One OpenCompass model class per family label (`Family.eval_label`), `Dare<label>`, made here
    from the family registry and registered with OpenCompass under its name and with FAMILY_CLASSES
    under each model_type it serves; a new family needs no edit in this file. Returns the names."""
    names = []
    for family in own_families():
        if family.eval_label is None:
            raise TypeError(f"model family '{family.model_type}' has no eval_label: it cannot be evaluated")
        name = f"Dare{family.eval_label}"
        cls = globals().get(name)
        if cls is None:
            cls = type(name, (DareModel,), {
                "__doc__": f"{family.eval_label} under OpenCompass, with its family's sampler defaults.",
                "__module__": __name__, "__qualname__": name, "family_sampler": family.sampler_defaults})
            MODELS.register_module(name=name, module=cls)
            globals()[name] = cls
            names.append(name)
        FAMILY_CLASSES.register(family.model_type)(cls)
    return names


FAMILY_CLASS_NAMES = _family_classes()


def model_class_for(folder: str | Path) -> type:
    config = read_json(Path(folder) / "config.json")
    return FAMILY_CLASSES.lookup(config.get("model_type", ""), hint=f"model_type of {folder}/config.json")


# --------------------------------------------------------------------------- inferencers


@ICL_INFERENCERS.register_module()
class DiffusionGenInferencer(GenInferencer):
    """GenInferencer that applies the benchmark's sampler settings while it runs."""

    def __init__(self, *args: Any, sampler: Optional[dict] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sampler = dict(sampler or {})

    def inference(self, *args: Any, **kwargs: Any):
        context = self.model.sampler_overrides(self.sampler) if hasattr(self.model, "sampler_overrides") else contextlib.nullcontext()
        with context:
            return super().inference(*args, **kwargs)


@ICL_INFERENCERS.register_module()
class ELBOChoiceInferencer(BaseInferencer):
    """Multiple choice by likelihood: the prediction is the label whose continuation (`choices`)
    has the highest ELBO after the rendered prompt. All options of all items go through the
    model in one batched call, so the batch size changes nothing but speed."""

    def __init__(self, model, max_out_len: int = 0, batch_size: int = 1, output_json_filepath: str = "./icl_inference_output",
                 output_json_filename: str = "predictions", **kwargs: Any):
        kwargs = {k: v for k, v in kwargs.items() if k in ("max_seq_len", "fix_id_list")}
        super().__init__(model=model, batch_size=batch_size, output_json_filepath=output_json_filepath,
                         output_json_filename=output_json_filename, **kwargs)

    def inference(self, retriever, ice_template=None, prompt_template=None, output_json_filepath: Optional[str] = None,
                  output_json_filename: Optional[str] = None) -> list:
        ds = retriever.test_ds
        prompts = [retriever.generate_prompt_for_generate_task(i, "", ice_template=ice_template, prompt_template=prompt_template)
                   for i in range(len(ds))]
        parsed = [self.model.parse_template(p, mode="gen") for p in prompts]
        contexts, conts, owner = [], [], []
        for i, row in enumerate(ds):
            for cont in row["choices"]:
                contexts.append(parsed[i])
                conts.append(cont)
                owner.append(i)
        scores = self.model.loglikelihood(contexts, conts)
        per_row: list = [[] for _ in range(len(ds))]
        for i, s in zip(owner, scores):
            per_row[i].append(s)
        results = {}
        for i, row in enumerate(ds):
            best = max(range(len(per_row[i])), key=lambda j: per_row[i][j])
            prompt = parsed[i] if isinstance(parsed[i], str) else list(parsed[i])
            results[str(i)] = {"origin_prompt": prompt, "prediction": row["labels"][best], "gold": row["answer"],
                               "loglikelihoods": dict(zip(row["labels"], per_row[i]))}
        path = Path(output_json_filepath or self.output_json_filepath) / (output_json_filename or self.output_json_filename)
        atomic_write_text(path, json.dumps(results, indent=2, ensure_ascii=False))
        return [r["prediction"] for r in results.values()]


# --------------------------------------------------------------------------- data and grading


@LOAD_DATASET.register_module()
class DareDataset(BaseDataset):
    """A benchmark of `dare_core.eval.configs`, read from the user's data folder."""

    @staticmethod
    def load(path: str, benchmark: str, options: Optional[dict] = None) -> Dataset:
        rows = get_benchmark(benchmark).load(Path(path), **(options or {}))
        if not rows:
            raise ValueError(f"{benchmark}: no test items found under {path}")
        return Dataset.from_list(rows)


@ICL_EVALUATORS.register_module()
class DareEvaluator(BaseEvaluator):
    """Accuracy (0-100) by the benchmark's own grader (`gen`) or by the predicted label (`ll`)."""

    def __init__(self, benchmark: str, mode: str = "gen", **kwargs: Any):
        super().__init__(**kwargs)
        self.benchmark, self.mode = benchmark, mode

    def score(self, predictions: list, references: list, test_set) -> dict:
        bench = get_benchmark(self.benchmark)
        details, total = [], 0.0
        for pred, row in zip(predictions, test_set):
            value = float(pred == row["answer"]) if self.mode == "ll" else bench.grade(dict(row), pred or "")
            total += value
            details.append({"id": row["id"], "pred": pred, "answer": row["answer"], "score": value, "correct": value == 1.0})
        n = max(len(details), 1)
        return {"accuracy": 100.0 * total / n, "details": details}


__all__ = ["DareModel", *FAMILY_CLASS_NAMES, "DiffusionGenInferencer", "ELBOChoiceInferencer",
           "DareDataset", "DareEvaluator", "model_class_for"]
