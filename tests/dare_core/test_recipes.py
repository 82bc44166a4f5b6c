"""Recipes (dare_core/recipes.py): dataclass defaults < params.yaml < the recipe < -S overrides, chosen
by `recipe:` in params.yaml, `-S recipe=...` or `dare stage --recipe`; clear errors for an unknown
or malformed recipe; every recipe in configs/recipes/ loads into a valid config."""
from __future__ import annotations

import pytest
import yaml

from dare_core.algorithms.registry import build_options, get_rl_algorithm
from dare_core.cli import build_parser, cmd_stage
from dare_core.config import load_config
from dare_core.recipes import RecipeError
from pipeline_helpers import REPO

RECIPES = REPO / "configs" / "recipes"


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "configs" / "recipes").mkdir(parents=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"rl": {"num_iterations": 2, "kl_beta": 0.0, "group_size": 8}}))
    (tmp_path / "configs" / "recipes" / "paper.yaml").write_text(
        "# a paper\nrl:\n  num_iterations: 12  # the paper's mu\n  kl_beta: 0.04\n  optim: {lr: 3.0e-6}\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_precedence(project):
    plain = load_config(project / "params.yaml")
    assert (plain.rl.num_iterations, plain.rl.kl_beta) == (2, 0.0)
    cfg = load_config(project / "params.yaml", ["recipe=paper"])
    # the recipe replaces what it sets, keeps the rest of params.yaml and the defaults of what neither sets
    assert (cfg.rl.num_iterations, cfg.rl.kl_beta, cfg.rl.optim.lr, cfg.rl.group_size) == (12, 0.04, 3.0e-6, 8)
    assert cfg.rl.optim.max_grad_norm == plain.rl.optim.max_grad_norm and cfg.recipe == "paper"
    # -S wins over the recipe, whichever comes first on the command line
    for sets in (["recipe=paper", "rl.num_iterations=3"], ["rl.num_iterations=3", "recipe=paper"]):
        assert load_config(project / "params.yaml", sets).rl.num_iterations == 3
    # chosen in params.yaml itself, as `dvc exp run -S recipe=paper` leaves it
    (project / "params.yaml").write_text(yaml.safe_dump({"recipe": "paper", "rl": {"num_iterations": 2}}))
    assert load_config(project / "params.yaml").rl.num_iterations == 12
    assert load_config(project / "params.yaml", ["recipe=null"]).rl.num_iterations == 2


def test_task_args_stay_with_their_task(project):
    (project / "params.yaml").write_text(yaml.safe_dump({"data": {"task": "arithmetic", "task_args": {"max_digits": 3}}}))
    (project / "configs" / "recipes" / "other.yaml").write_text("data:\n  task: countdown  # another task\n")
    (project / "configs" / "recipes" / "same.yaml").write_text("data:\n  num_rl: 10  # the same task\n")
    assert load_config(project / "params.yaml", ["recipe=other"]).data.task_args == {}
    assert load_config(project / "params.yaml", ["recipe=same"]).data.task_args == {"max_digits": 3}


def test_model_init_stays_with_its_family(project):
    (project / "params.yaml").write_text(yaml.safe_dump({"model": {"family": "llada", "init": {"d_model": 32, "n_layers": 2}}}))
    (project / "configs" / "recipes" / "gemma.yaml").write_text(
        "model:\n  family: diffusion_gemma  # another family\n  init: {hidden_size: 64}\n")
    (project / "configs" / "recipes" / "bare.yaml").write_text("model:\n  family: sdar  # its own defaults\n")
    (project / "configs" / "recipes" / "wider.yaml").write_text("model:\n  init: {d_model: 64}  # the same family\n")
    assert load_config(project / "params.yaml", ["recipe=gemma"]).model.init == {"hidden_size": 64}
    assert load_config(project / "params.yaml", ["recipe=bare"]).model.init == {}
    assert load_config(project / "params.yaml", ["recipe=wider"]).model.init == {"d_model": 64, "n_layers": 2}


def test_cli_recipe_flag_is_a_set(project, monkeypatch):
    seen = {}
    import dare_core.workers.prepare as worker

    monkeypatch.setattr(worker, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    args = build_parser().parse_args(["stage", "prepare", "--recipe", "paper", "-S", "rl.kl_beta=0.1"])
    cmd_stage(args)
    assert seen["argv"][:4] == ["--params", "params.yaml", "--set=recipe=paper", "--set=rl.kl_beta=0.1"]


def test_errors(project):
    with pytest.raises(RecipeError, match=r"unknown recipe 'nope' .*recipes: paper"):
        load_config(project / "params.yaml", ["recipe=nope"])
    with pytest.raises(RecipeError, match="recipe file not found: other/x.yaml"):
        load_config(project / "params.yaml", ["recipe=other/x.yaml"])
    (project / "configs" / "recipes" / "loop.yaml").write_text("recipe: paper\n")
    with pytest.raises(RecipeError, match="cannot name another recipe"):
        load_config(project / "params.yaml", ["recipe=loop"])
    (project / "configs" / "recipes" / "typo.yaml").write_text("rl:\n  num_iteration: 3\n")
    with pytest.raises(ValueError, match="num_iteration"):
        load_config(project / "params.yaml", ["recipe=typo"])


def test_a_preset_extends_another(project):
    """`extends:` applies the base first and the preset over it; a path is read beside the preset
    first, a name from configs/recipes/; a chain that comes back to itself is refused."""
    presets = project / "presets"
    presets.mkdir()
    (presets / "base.yaml").write_text("rl:\n  num_iterations: 4\n  group_size: 16\n  optim: {lr: 1.0e-5}\n")
    (presets / "longer.yaml").write_text("extends: base.yaml\nrl:\n  group_size: 4\n")
    (presets / "on_paper.yaml").write_text("extends: paper\nrl:\n  kl_beta: 0.0\n")
    (presets / "twice.yaml").write_text("extends: longer.yaml\nrl:\n  num_iterations: 6\n")
    cfg = load_config(project / "params.yaml", [f"recipe={presets / 'twice.yaml'}"])
    assert (cfg.rl.num_iterations, cfg.rl.group_size, cfg.rl.optim.lr) == (6, 4, 1.0e-5)
    cfg = load_config(project / "params.yaml", [f"recipe={presets / 'on_paper.yaml'}"])
    assert (cfg.rl.num_iterations, cfg.rl.kl_beta, cfg.rl.optim.lr) == (12, 0.0, 3.0e-6)
    (presets / "a.yaml").write_text("extends: b.yaml\n")
    (presets / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(RecipeError, match="extends it back"):
        load_config(project / "params.yaml", [f"recipe={presets / 'a.yaml'}"])
    (presets / "bad.yaml").write_text("extends: [base.yaml]\n")
    with pytest.raises(RecipeError, match="extends must name a recipe or a path"):
        load_config(project / "params.yaml", [f"recipe={presets / 'bad.yaml'}"])


@pytest.mark.parametrize("length", ["8k", "16k"])
def test_long_generation_presets_change_only_what_the_length_changes(length):
    """The 8k and 16k presets are the 4k one with their own lengths and batch sizes."""
    from dataclasses import asdict

    base = asdict(load_config(REPO / "params.yaml", ["recipe=configs/long_generation.yaml"]))
    longer = asdict(load_config(REPO / "params.yaml", [f"recipe=configs/long_generation_{length}.yaml"]))
    longer["recipe"] = base["recipe"]

    def differences(a, b, where=""):
        if isinstance(a, dict):
            return {d for k in a for d in differences(a[k], b[k], f"{where}.{k}".strip("."))}
        return set() if a == b else {where}

    allowed = {"rl.prompts_per_step", "rl.micro_batch_size", "rl.sampler.gen_length", "rl.sampler.steps",
               "rl.sampler.batch_size", "eval.sampler.gen_length", "eval.sampler.steps", "eval.sampler.batch_size"}
    changed = differences(base, longer)
    assert {"rl.sampler.gen_length", "rl.sampler.steps", "eval.sampler.gen_length"} <= changed <= allowed


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_loads_and_names_its_sources(path):
    cfg = load_config(REPO / "params.yaml", [f"recipe={path}"])
    if cfg.rl.algorithm == path.stem:
        build_options(get_rl_algorithm(cfg.rl.algorithm), cfg.rl.algorithm_args.get(cfg.rl.algorithm, {}), path.stem)
    text = path.read_text()
    assert "arXiv" in text or "github.com" in text, f"{path.name}: the header names no source"
    # every value line carries a comment saying where it comes from
    bare = [line for line in text.splitlines() if ":" in line and not line.strip().startswith("#")
            and not line.rstrip().endswith(":") and "#" not in line]
    assert not bare, f"{path.name}: values without a source comment: {bare}"


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_algorithm_defaults_are_the_recipes(path):
    """An algorithm's options default to its paper's values: what its recipe writes out is what
    `-S rl.algorithm=<name>` gets (None / "auto": derived from other settings, e.g. d-TreeRPO's roots,
    BGPO's ELBO normaliser)."""
    import dataclasses

    tree = yaml.safe_load(path.read_text())
    name = (tree.get("rl") or {}).get("algorithm")
    if name != path.stem:
        pytest.skip("not an RL recipe")
    defaults = {f.name: f.default for f in dataclasses.fields(get_rl_algorithm(name).Options)}
    written = ((tree["rl"].get("algorithm_args") or {}).get(name)) or {}
    differ = {k: (v, defaults[k]) for k, v in written.items() if defaults[k] not in (None, "auto") and v != defaults[k]}
    assert not differ, f"{name}: recipe value vs Options default: {differ}"


def test_llada_long_generation_preset_fits_the_models_positions():
    """The masked-diffusion preset: the 4k one on LLaDA, its longest prompt plus response within
    LLaDA-8B's 4,096 positions, decoded with the dual cache at d1's two tokens a step."""
    import json

    cfg = load_config(REPO / "params.yaml", ["recipe=configs/long_generation_llada.yaml"])
    positions = json.loads((REPO / "bench" / "configs" / "LLaDA-8B-Instruct.json").read_text())["max_sequence_length"]
    s = cfg.rl.sampler
    assert cfg.model.family == "llada" and s.cache == "dual" and cfg.eval.sampler.cache == "dual"
    assert s.gen_length + 256 == positions and s.gen_length % s.block_length == 0
    assert s.steps * 2 == s.gen_length
    assert cfg.model.lora and cfg.model.logits_chunk  # the rest comes from the 4k preset
