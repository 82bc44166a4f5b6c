"""The OpenCompass path end to end on fixture files (real OpenCompass, as a subprocess).

- every benchmark config, in both modes where it has two, runs with tiny models of a masked and a
  block-diffusion family and produces a score;
- graders: a model answering with the references scores 100 on every fixture, garbage scores 0;
- the same checkpoint and seed give identical predictions and numbers.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dare_core.data.schema import write_rows
from dare_core.eval.configs import BENCHMARKS, MissingBenchmarkData, get_benchmark
from dare_core.eval.runner import BenchmarkSpec, benchmark_specs, evaluate_folders
from dare_core.models.tokenizer import char_tokenizer
from eval_fixtures import write_benchmark_fixtures
from eval_helpers import opencompass_env, tiny_folder

PUBLIC = [b for b in BENCHMARKS if b != "task"]
MULTIPLE_CHOICE = [b for b in PUBLIC if "ll" in get_benchmark(b).modes]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("benchmarks")
    write_benchmark_fixtures(root, n=3)
    tok = char_tokenizer()
    rows = [{"prompt": f"{i}+{i}=", "prompt_text": tok.apply_chat_template([{"role": "user", "content": f"{i}+{i}="}]),
             "ground_truth": str(2 * i), "task": "arithmetic", "uid": f"e{i}"} for i in range(5)]
    write_rows(root / "prepared" / "eval.parquet", rows, "eval")
    return root


def all_specs(data: Path, sampler: dict | None = None) -> list:
    args = {b: {"sampler": sampler} for b in PUBLIC} if sampler else {}
    specs = benchmark_specs(PUBLIC + ["task"], data, args, data_dirs={"task": data / "prepared"})
    for name in MULTIPLE_CHOICE:
        specs.append(BenchmarkSpec(name, mode="ll", data_dir=data))
    return specs


def test_twelve_benchmarks_are_registered():
    assert len(PUBLIC) == 12
    assert set(MULTIPLE_CHOICE) == {"mmlu", "mmlu_pro", "hellaswag", "arc_c", "gpqa"}


def test_reference_answers_score_100_and_garbage_scores_0(data, tmp_path):
    scripted = {"data_dir": str(data), "task_data": str(data / "prepared")}
    models = {"oracle": {"folder": "oracle", "model_class": "eval_oracle.OracleModel", **scripted},
              "garbage": {"folder": "garbage", "model_class": "eval_oracle.GarbageModel", **scripted}}
    results = evaluate_folders(models, all_specs(data), tmp_path / "oc", env=opencompass_env(), quiet=True)
    expected = [b for b in PUBLIC] + ["arithmetic"] + [f"{b}_ll" for b in MULTIPLE_CHOICE]
    assert sorted(results["oracle"]) == sorted(expected)
    assert results["oracle"] == {b: 100.0 for b in expected}
    assert results["garbage"] == {b: 0.0 for b in expected}
    summary = (tmp_path / "oc" / "run" / "summary.md").read_text()
    assert "gsm8k" in summary and "oracle" in summary


def test_an_opencompass_class_per_family_label():
    """The model classes are made from the family registry, under the names configs and docs use."""
    from dare_core.eval import opencompass as oc
    from dare_core.models.family import own_families

    for family in own_families():
        cls = oc.FAMILY_CLASSES[family.model_type]
        assert cls.__name__ == f"Dare{family.eval_label}" and getattr(oc, cls.__name__) is cls
        assert issubclass(cls, oc.DareModel) and cls.family_sampler == family.sampler_defaults
    assert set(oc.FAMILY_CLASS_NAMES) == {"DareLLaDA", "DareDream", "DareSDAR", "DareLLaDA2", "DareDiffusionGemma"}
    assert oc.FAMILY_CLASSES["sdar"] is oc.FAMILY_CLASSES["sdar_moe"]


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_every_config_runs_with_a_tiny_model(data, tmp_path, family):
    folder = tiny_folder(tmp_path, family)
    sampler = {"gen_length": 8, "steps": 8, "block_length": 4}
    results = evaluate_folders({family: folder}, all_specs(data, sampler), tmp_path / "oc",
                               model_options={"sampler": {"gen_length": 4, "steps": 4, "block_length": 4}, "ll_mc_num": 2},
                               batch_size=4, quiet=True)
    scores = results[family]
    assert len(scores) == 12 + 1 + 5
    assert all(0.0 <= v <= 100.0 for v in scores.values())
    preds = json.loads((tmp_path / "oc" / "run" / "predictions" / family / "mmlu_ll.json").read_text())
    assert all(set(p["loglikelihoods"]) == {"A", "B", "C", "D"} for p in preds.values())


def test_same_checkpoint_and_seed_give_identical_numbers(data, tmp_path):
    """Twice through OpenCompass: bitwise the same predictions, likelihoods and scores (batch-size
    invariance is pinned without OpenCompass in test_lm.py)."""
    folder = tiny_folder(tmp_path, "llada", seed=3)
    specs = benchmark_specs(["gsm8k", "task"], data, {"gsm8k": {"sampler": {"gen_length": 8, "steps": 8, "block_length": 8}}},
                            data_dirs={"task": data / "prepared"}) + [BenchmarkSpec("hellaswag", mode="ll", data_dir=data)]
    options = {"sampler": {"gen_length": 4, "steps": 4, "block_length": 4, "temperature": 1.0}, "ll_mc_num": 4, "seed": 7}
    runs = []
    for i in range(2):
        out = tmp_path / f"oc{i}"
        results = evaluate_folders({"m": folder}, specs, out, options, batch_size=3, quiet=True)
        preds = {f.name: json.loads(f.read_text()) for f in sorted((out / "run" / "predictions" / "m").glob("*.json"))}
        runs.append((results, preds))
    assert runs[0] == runs[1]
    assert set(runs[0][1]) == {"gsm8k.json", "arithmetic.json", "hellaswag_ll.json"}


def test_a_missing_benchmark_file_fails_before_any_model_loads(tmp_path):
    with pytest.raises(MissingBenchmarkData) as err:
        benchmark_specs(["gsm8k"], tmp_path)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in str(err.value) and "gsm8k" in str(err.value)
    with pytest.raises(ValueError, match="mode 'll' not available"):
        benchmark_specs(["gsm8k"], tmp_path, {"gsm8k": {"mode": "ll"}})
    with pytest.raises(ValueError, match="unknown keys"):
        benchmark_specs(["gsm8k"], tmp_path, {"gsm8k": {"shot": 3}})


def test_settings_are_checked_per_family_and_benchmark_before_anything_is_written(data, tmp_path):
    from dare_core.eval.runner import check_models

    specs = benchmark_specs(["gsm8k", "task"], data, data_dirs={"task": data / "prepared"})
    llada, sdar = tiny_folder(tmp_path, "llada"), tiny_folder(tmp_path, "sdar")
    check_models({"l": llada}, specs, {"sampler": {"cache": "dual"}})
    check_models({"s": sdar}, specs, {"sampler": {"cache": "block_kv"}})
    with pytest.raises(ValueError, match=r"llada_0: sampler settings: cache 'block_kv' does not apply to a masked-diffusion"):
        check_models({"l": llada}, specs, {"sampler": {"cache": "block_kv"}})
    # the model-wide settings fit, one benchmark's own do not: the message names it
    gsm8k_prefix = [BenchmarkSpec("gsm8k", sampler={"cache": "prefix"}, data_dir=data)]
    with pytest.raises(ValueError, match=r"sdar_0, benchmark 'gsm8k': sampler settings: cache 'prefix' does not apply to a block"):
        check_models({"s": sdar}, gsm8k_prefix, {"sampler": {"cache": "block_kv"}})
    spec = BenchmarkSpec("gsm8k", sampler={"gen_length": 8, "steps": 16, "block_length": 8}, data_dir=data)
    work = tmp_path / "not" / "created"
    with pytest.raises(ValueError, match=r"benchmark 'gsm8k': sampler settings: steps 16 > gen_length 8"):
        evaluate_folders({"l": llada}, [spec], work)
    assert not (tmp_path / "not").exists()


def test_an_opencompass_failure_names_its_cause_and_leaves_nothing(data, tmp_path):
    """A failure inside OpenCompass (here: a scripted model whose data folder is missing) is reported
    by the exception it died of; the run folder and the parents it created are gone, the log kept."""
    from dare_core.eval.runner import EvalRunError

    specs = benchmark_specs(["task"], None, data_dirs={"task": data / "prepared"})
    broken = {"o": {"folder": "oracle", "model_class": "eval_oracle.OracleModel", "data_dir": str(tmp_path / "nowhere")}}
    with pytest.raises(EvalRunError) as err:
        evaluate_folders(broken, specs, tmp_path / "w" / "oc", env=opencompass_env(), quiet=True)
    message = str(err.value)
    assert "MissingBenchmarkData: " in message and str(tmp_path / "nowhere") in message and "\n" not in message
    log = Path(message.rsplit("full log: ", 1)[1].rstrip(")"))
    assert "Traceback" in log.read_text()
    log.unlink()
    assert not (tmp_path / "w").exists()
