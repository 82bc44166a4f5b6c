"""docs/architecture.md's "What a change touches" table holds for every current member: each RL
algorithm, model family and rollout engine lives in the files its row names, and one new file in
the engines folder is all a new engine needs for `rl.sampler.engine` to accept it. The RL schedule
row is another test's (test_rl_schedule.py)."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def table_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## What a change touches", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("a new "):
            rows[cells[0]] = cells[1]
    return rows


def named_paths(row: str) -> list[str]:
    """The project paths a row's files cell names in backticks."""
    return [p for p in re.findall(r"`([^`\s]+)`", row) if "/" in p]


def test_table_has_its_rows():
    assert set(table_rows()) >= {"a new RL algorithm", "a new model family", "a new RL schedule", "a new rollout engine"}


def test_an_rl_algorithm_is_its_module_recipe_and_test():
    from dare_core.algorithms.base import RLAlgorithm
    from dare_core.algorithms.registry import RL_ALGORITHMS

    patterns = named_paths(table_rows()["a new RL algorithm"])
    assert patterns == ["dare_core/algorithms/<name>.py", "configs/recipes/<name>.yaml",
                        "tests/dare_core/algorithms/test_<name>.py"]
    for name, cls in RL_ALGORITHMS.items():
        if not issubclass(cls, RLAlgorithm):
            continue
        assert Path(inspect.getsourcefile(cls)) == ROOT / patterns[0].replace("<name>", name), name
        for pattern in patterns[1:]:
            assert (ROOT / pattern.replace("<name>", name)).is_file(), f"{name}: no {pattern}"


def test_a_family_is_its_model_file_and_its_tiny_model():
    import tiny_models
    from dare_core import models
    from dare_core.models.family import FAMILIES

    assert named_paths(table_rows()["a new model family"]) == ["dare_core/models/<family>.py", "tests/tiny_models.py"]
    for model_type, family in FAMILIES.items():
        # the module that holds the registered Family: one file of its own under models/
        homes = [m for m in sys.modules.values() if getattr(m, "__name__", "").startswith("dare_core.models.")
                 and any(v is family for v in vars(m).values()) and not m.__name__.endswith(".family")]
        assert homes, model_type
        assert all(Path(m.__file__).parent == Path(models.__file__).parent for m in homes), model_type
        assert model_type in tiny_models.FAMILIES + tiny_models.UNIFORM_FAMILIES and model_type in tiny_models.SMALL, model_type


def test_an_engine_is_its_module_and_every_engine_declares_its_capabilities():
    from dare_core.models.family import own_families
    from dare_core.sampling import engines
    from dare_core.sampling.engines import ENGINES

    assert named_paths(table_rows()["a new rollout engine"])[0] == "dare_core/sampling/engines/<name>.py"
    folder = Path(engines.__file__).parent
    for name, cls in ENGINES.items():
        assert cls.name == name
        assert (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file(), name
        assert cls.__module__.split(".")[:4] == ["dare_core", "sampling", "engines", name], cls.__module__
        assert isinstance(cls.tree_rollouts, bool), f"{name} does not declare tree_rollouts"
        assert isinstance(cls.decodes_policy, bool), f"{name} does not declare decodes_policy"
        assert callable(getattr(cls, "generate_tree", None)) == cls.tree_rollouts, name
    for family in own_families():
        assert set(family.engines) <= set(ENGINES), family.model_type


NEW_ENGINE = '''
from dare_core.sampling.engines import ENGINES
from dare_core.sampling.engines.native import NativeEngine


@ENGINES.register("throwaway")
class ThrowawayEngine(NativeEngine):
    name = "throwaway"
'''

# the engines package found with one more folder on its path, as if the new file were in its own
CHECK = '''
import importlib.abc, importlib.machinery, sys
extra = sys.argv[1]


class EnginesWithOneMoreFolder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "dare_core.sampling.engines":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.submodule_search_locations.append(extra)
        return spec


sys.meta_path.insert(0, EnginesWithOneMoreFolder())
sys.path.insert(0, sys.argv[2])
from tiny_models import tiny
from dare_core.config import ConfigError, DareConfig, RLConfig, SamplerConfig
from dare_core.sampling.engines import engines_with
from dare_core.training.rl.checks import check_rl_settings

model = tiny("llada")
sampler = dict(gen_length=8, steps=8, block_length=8)
check_rl_settings(DareConfig(rl=RLConfig(sampler=SamplerConfig(engine="throwaway", **sampler))), model)
tree = RLConfig(algorithm="d_tree_rpo", group_size=16, micro_batch_size=20, sampler=SamplerConfig(engine="throwaway", **sampler))
check_rl_settings(DareConfig(rl=tree), model)
assert "throwaway" in engines_with("tree_rollouts")
try:
    check_rl_settings(DareConfig(rl=RLConfig(sampler=SamplerConfig(engine="nosuch", **sampler))), model)
except ConfigError as exc:
    assert "unknown rollout engine 'nosuch'" in str(exc) and "throwaway" in str(exc), exc
else:
    raise AssertionError("an unknown engine was accepted")
print("accepted")
'''


def test_a_new_engine_is_one_file(tmp_path):
    """An engine module dropped beside the others (here: in a folder the package also searches) is
    registered, accepted by the RL stage's checks as `rl.sampler.engine`, and, declaring tree
    rollouts, by d-TreeRPO's: no list elsewhere names it."""
    from dare_core.sampling.engines import ENGINES

    assert "throwaway" not in ENGINES
    (tmp_path / "throwaway.py").write_text(textwrap.dedent(NEW_ENGINE))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path), str(ROOT / "tests")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "accepted" in done.stdout, done.stderr[-3000:]


def test_tree_rollouts_are_asked_of_the_engine_not_its_name():
    from algo_helpers import make_algo
    from dare_core.config import RLConfig, SamplerConfig
    from tiny_models import tiny

    rl = RLConfig(group_size=16, sampler=SamplerConfig(gen_length=8, steps=8, block_length=8, engine="lmdeploy"))
    with pytest.raises(ValueError, match=r"engine: native \(an engine with tree rollouts"):
        make_algo("d_tree_rpo", tiny("llada"), rl)
