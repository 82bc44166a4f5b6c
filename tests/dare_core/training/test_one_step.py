"""Every RL algorithm runs a step on the embedded task with nothing but `rl.algorithm=<name>` (its
options take their defaults), and every paper recipe in configs/recipes/ loads and runs a step of
its stage on the tiny model: the recipe's algorithm, options, inner updates, clipping, KL and
learning rate as written, only sizes, model and data swapped for the tiny ones."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from dare_core.algorithms.base import RLAlgorithm
from dare_core.algorithms.registry import RL_ALGORITHMS as REGISTERED_RL
from dare_core.config import load_config
from dare_core.data.prepare import prepare
from pipeline_helpers import REPO, dare, tiny_params, worker_env, write_params

RECIPES = REPO / "configs" / "recipes"
RL_ALGORITHMS = sorted(name for name in REGISTERED_RL if issubclass(REGISTERED_RL[name], RLAlgorithm))

# the tiny stand-ins for what a recipe takes from the real world (a model folder, a dataset, a
# reward for it, long generations); everything else comes from the recipe as written
SHRINK = {
    "model.path": None, "model.family": "llada", "model.dtype": "float32", "model.compile": False,
    "launch.launcher": "local", "launch.nproc": 1, "launch.zero_stage": 0,
    "data.source": None, "data.task": "arithmetic", "data.eval_source": None, "data.val_source": None,
    "rl.num_steps": 1, "rl.prompts_per_step": 2, "rl.mini_batches": 1, "rl.micro_batch_size": 64,
    "rl.validate_every": 0, "rl.save_every": 1, "rl.reward": "auto", "rl.reward_args": {},
    "rl.sampler.gen_length": 4, "rl.sampler.steps": 4, "rl.sampler.block_length": 4, "rl.sampler.batch_size": 64,
    "rl.optim.warmup_steps": 0,
    "sft.max_steps": 1, "sft.micro_batch_size": 16, "sft.grad_accum": 1, "sft.pad_to": 4, "sft.save_every": 1,
    "sft.optim.warmup_steps": 0,
    "preference.max_steps": 1, "preference.micro_batch_size": 4, "preference.grad_accum": 1, "preference.pad_to": 4,
    "preference.save_every": 1, "preference.optim.warmup_steps": 0,
}


# rollouts with token editing (docs/algorithms.md#edited-rollouts), for the algorithms that replay them
EDITING = ["rl.sampler.unmasking=threshold", "rl.sampler.threshold=0.5", "rl.sampler.edit_threshold=0.0",
           "rl.sampler.post_edit_steps=2"]
EDITED_REPLAYS = ("cj_grpo", "mdpo")


def _sets(values: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def recipe_stage(name: str) -> str:
    tree = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    return "rl" if "rl" in tree and "algorithm" in tree["rl"] else "preference" if "preference" in tree else "sft"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Prepared data and a few SFT steps of the tiny model: every run below starts from a copy."""
    root = tmp_path_factory.mktemp("one_step")
    params = write_params(root / "params.yaml", tiny_params(root, sft__max_steps=10))
    prepare(load_config(params))
    r = subprocess.run(dare("stage", "sft", "--params", str(params)), env=worker_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def results(base, tmp_path_factory):
    import shutil

    runs = []
    for label, stage, overrides in [*(
            (f"algorithm:{name}", "rl", [f"rl.algorithm={name}"]) for name in RL_ALGORITHMS), *(
            (f"editing:{name}", "rl", [f"rl.algorithm={name}", *EDITING]) for name in EDITED_REPLAYS), *(
            (f"recipe:{name}", recipe_stage(name), [f"recipe={RECIPES / name}.yaml", *_sets(SHRINK)]) for name in recipe_names())]:
        root = tmp_path_factory.mktemp(label.replace(":", "_"))
        shutil.copytree(base / "data", root / "data")
        if stage != "sft":
            shutil.copytree(base / "runs" / "t" / "sft", root / "runs" / "t" / "sft")
        params = write_params(root / "params.yaml", tiny_params(root, rl__num_steps=1, rl__validate_every=0, rl__group_size=8))
        runs.append({"label": label, "stage": stage, "params": str(params), "overrides": overrides})
    # sft.max_steps 0: the SFT stage passes model.path through unchanged (RL from a released model)
    root = tmp_path_factory.mktemp("pass_through")
    shutil.copytree(base / "data", root / "data")
    params = write_params(root / "params.yaml", tiny_params(root))
    runs.append({"label": "sft:pass-through", "stage": "sft", "params": str(params),
                 "overrides": [f"model.path={base / 'runs' / 't' / 'sft' / 'model'}", "sft.max_steps=0"]})
    spec = base / "runs.json"
    spec.write_text(json.dumps(runs))
    r = subprocess.run([sys.executable, str(REPO / "tests" / "one_step_runs.py"), str(spec)], env=worker_env(),
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    found = {}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            found[result["label"]] = result
    return found


@pytest.mark.parametrize("name", RL_ALGORITHMS)
def test_every_algorithm_runs_on_the_embedded_task_by_name(results, name):
    result = results[f"algorithm:{name}"]
    assert result["ok"], result.get("trace")
    assert result["algorithm"] == name and result["metrics"]["steps"] == 1


@pytest.mark.parametrize("name", EDITED_REPLAYS)
def test_trajectory_replays_run_a_step_on_edited_rollouts(results, name):
    result = results[f"editing:{name}"]
    assert result["ok"], result.get("trace")
    assert result["algorithm"] == name and result["metrics"]["steps"] == 1


def test_a_recipe_for_every_algorithm_and_stage():
    assert set(recipe_names()) == set(RL_ALGORITHMS) | {"sft", "vrpo"}


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_runs_a_step(results, name):
    result = results[f"recipe:{name}"]
    assert result["ok"], result.get("trace")
    if recipe_stage(name) == "rl":
        assert result["algorithm"] == name


def test_sft_max_steps_0_exports_the_given_model_unchanged(results, base):
    from safetensors.torch import load_file

    result = results["sft:pass-through"]
    assert result["ok"], result.get("trace")
    assert result["metrics"]["steps"] == 0 and result["metrics"]["final_loss"] is None
    out = next(p for p in base.parent.glob("pass_through*/runs/t/sft"))
    given = {k: v for f in (base / "runs/t/sft/model").glob("*.safetensors") for k, v in load_file(f).items()}
    exported = {k: v for f in (out / "model").glob("*.safetensors") for k, v in load_file(f).items()}
    assert given.keys() == exported.keys() and all(given[k].equal(exported[k]) for k in given)
    assert (out / "checkpoints").is_dir() and (out / "metrics.jsonl").is_file()  # the stage's DVC outputs
