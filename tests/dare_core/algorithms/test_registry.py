"""Selecting an algorithm is one config key: `rl.algorithm: <name>` with the committed params.yaml
builds every registered RL algorithm (or says exactly what its rollout needs), and each algorithm's
options live under its own name in `rl.algorithm_args`."""
import pytest

from conftest import make_tiny_llada
from tiny_models import tiny
from dare_core.algorithms.registry import RL_ALGORITHMS as REGISTERED_RL, build_algorithm, get_rl_algorithm
from dare_core.config import ConfigError, load_config

get_rl_algorithm("d1")  # imports every algorithm module
RL_ALGORITHMS = sorted(REGISTERED_RL)


# what the embedded sampler (gen 6, block 6, one token per step) lacks for the two special rollouts
NEEDS = {"just_grpo": ["rl.sampler.block_length=1"], "d_tree_rpo": ["rl.group_size=16"],
         # block diffusion only: a tiny SDAR (blocks of 4) with a rollout of whole blocks
         "ebpo": ["rl.sampler.gen_length=8", "rl.sampler.block_length=4", "rl.sampler.steps=8"]}


@pytest.mark.parametrize("name", RL_ALGORITHMS)
def test_params_yaml_builds_every_algorithm(name):
    cfg = load_config("params.yaml", [f"rl.algorithm={name}"] + NEEDS.get(name, []))
    model = tiny("sdar") if name == "ebpo" else make_tiny_llada()
    assert build_algorithm(cfg.rl, model).name == name


def test_special_rollouts_say_what_they_need():
    # params.yaml's sampler as it is builds (just_grpo rolls out left to right itself) ...
    build_algorithm(load_config("params.yaml", ["rl.algorithm=just_grpo"]).rl, make_tiny_llada())
    # ... but a cache it cannot score exactly is refused, naming the setting
    cfg = load_config("params.yaml", ["rl.algorithm=just_grpo", "rl.sampler.cache=prefix"])
    with pytest.raises(ValueError, match="cache: none"):
        build_algorithm(cfg.rl, make_tiny_llada())


def test_options_are_per_algorithm_and_validated():
    # d1's options in params.yaml never reach another algorithm
    cfg = load_config("params.yaml", ["rl.algorithm=bgpo", "rl.algorithm_args={d1: {p_mask_prompt: 0.0}, bgpo: {mc_num: 3}}"])
    assert build_algorithm(cfg.rl, make_tiny_llada()).options.mc_num == 3
    bad = load_config("params.yaml", ["rl.algorithm_args={bgpo: {mc_nums: 3}}"])
    with pytest.raises(ConfigError, match="rl.algorithm_args.bgpo.mc_nums"):
        build_algorithm(bad.rl, make_tiny_llada())
    unknown = load_config("params.yaml", ["rl.algorithm_args={bgpoo: {}}"])
    with pytest.raises(Exception, match="bgpoo"):
        build_algorithm(unknown.rl, make_tiny_llada())
