"""Paper recipes: `configs/recipes/<name>.yaml`, each a partial params.yaml holding one paper's
settings with a comment naming the source of every value.

A recipe is applied on top of params.yaml and under command-line overrides:
dataclass defaults < params.yaml < the recipe < `-S key=value`. It is chosen by the top-level
`recipe:` key (so `dvc exp run -S recipe=d1` works and DVC tracks the choice) or by
`dare stage <name> --recipe d1`, which is the same as `-S recipe=d1`. Sections merge key by key,
except that a recipe naming another `data.task` than params.yaml drops params.yaml's
`data.task_args` (they are that other task's), and one naming another `model.family` drops
params.yaml's `model.init` (that other family's sizes) for its own.

A preset may build on another with `extends: <name or path>` (a path relative to its own folder
first): the base is applied first and the preset's own values over it, so a preset that changes
one setting of another (a longer response) holds that setting and its reason alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from dare_core.errors import UserError
from dare_core.storage import read_yaml_mapping

RECIPE_DIR = Path("configs") / "recipes"


class RecipeError(UserError):
    """A recipe that cannot be found or read."""


def recipe_dirs(params_path: Union[str, Path]) -> list[Path]:
    """Where recipe names are looked up: next to the params file, then the working directory."""
    dirs = [Path(params_path).resolve().parent / RECIPE_DIR, Path.cwd() / RECIPE_DIR]
    return list(dict.fromkeys(dirs))


def available(params_path: Union[str, Path] = "params.yaml") -> list[str]:
    return sorted({p.stem for d in recipe_dirs(params_path) if d.is_dir() for p in d.glob("*.yaml")})


def names_a_file(name: str) -> bool:
    """Whether recipe `name` is a path to a YAML file rather than a name under configs/recipes/."""
    as_path = Path(name)
    return as_path.suffix in (".yaml", ".yml") or len(as_path.parts) > 1


def find_recipe(name: str, params_path: Union[str, Path] = "params.yaml") -> Path:
    """The file of recipe `name`: a path to a YAML file, or a name under configs/recipes/."""
    as_path = Path(name)
    if names_a_file(name):
        if as_path.is_file():
            return as_path
        raise RecipeError(f"recipe file not found: {name}")
    for d in recipe_dirs(params_path):
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    known = ", ".join(available(params_path)) or "none found"
    raise RecipeError(f"unknown recipe '{name}' (looked in {', '.join(str(d) for d in recipe_dirs(params_path))}; "
                      f"recipes: {known})")


def read_recipe(path: Path, params_path: Union[str, Path] = "params.yaml", chain: tuple = ()) -> dict:
    """The recipe at `path`, over the recipes it `extends` (applied first)."""
    tree = read_yaml_mapping(path, RecipeError, "a mapping of params.yaml sections (a recipe)")
    if "recipe" in tree:
        raise RecipeError(f"{path}: a recipe cannot name another recipe (`extends: <name>` builds on one)")
    base_name = tree.pop("extends", None)
    if base_name is None:
        return tree
    if not isinstance(base_name, str) or not base_name:
        raise RecipeError(f"{path}: extends must name a recipe or a path, got {base_name!r}")
    beside = path.parent / base_name
    base_path = beside if names_a_file(base_name) and beside.is_file() else find_recipe(base_name, params_path)
    seen = chain + (path.resolve(),)
    if base_path.resolve() in seen:
        raise RecipeError(f"{path}: extends {base_name}, which extends it back ({' -> '.join(str(p) for p in seen)})")
    return merged(read_recipe(base_path, params_path, seen), tree)


def merged(base: dict, over: dict) -> dict:
    """`over` on top of `base`: sections merge key by key, any other value replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def apply_recipe(raw: dict, name: Optional[Any], params_path: Union[str, Path]) -> dict:
    """params.yaml's tree with recipe `name` (None: none) applied."""
    if name in (None, "", "none"):
        return raw
    if not isinstance(name, str):
        raise RecipeError(f"recipe must be a name or a path, got {name!r}")
    recipe = read_recipe(find_recipe(name, params_path), params_path)
    out = merged(raw, recipe)
    data = recipe.get("data") or {}
    if "task" in data and "task_args" not in data and data["task"] != (raw.get("data") or {}).get("task"):
        # params.yaml's task_args belong to its own task (arithmetic digits, say), not the recipe's
        out["data"] = {**out["data"], "task_args": {}}
    model = recipe.get("model") or {}
    if "family" in model and model["family"] != (raw.get("model") or {}).get("family"):
        # params.yaml's model.init sizes another family's config.json: the recipe's (or none) replaces it whole
        out["model"] = {**out["model"], "init": model.get("init") or {}}
    return out


# the lengths `lengths: auto` derives from the data (data/lengths.py)
SAMPLER_KEYS = ("gen_length", "block_length", "steps")
SAMPLER_LENGTHS = {key: "auto" for key in SAMPLER_KEYS}
AUTO_LENGTHS = {"sft": {"pad_to": "auto"}, "preference": {"pad_to": "auto"}, "rl": {"sampler": SAMPLER_LENGTHS},
                "eval": {"sampler": SAMPLER_LENGTHS}}
MODEL_LENGTH_KEYS = ("max_sequence_length", "max_position_embeddings")  # what families call a model's length


def all_auto(raw: dict) -> dict:
    """params.yaml's tree with every length set to `auto` (`lengths: auto`, one key instead of nine):
    each canvas, sampler length and step count, and a from-scratch model's length where its
    `model.init` names one. An explicit `-S` override, applied after, still wins."""
    over: dict = dict(AUTO_LENGTHS)
    init = (raw.get("model") or {}).get("init")  # unused with a model.path, whose length is its own
    if isinstance(init, dict):
        named = {key: "auto" for key in MODEL_LENGTH_KEYS if key in init}
        if named:
            over["model"] = {"init": named}
    return merged(raw, over)
