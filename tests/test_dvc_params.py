"""dvc.yaml and params.yaml agree: every tracked param exists, and params.yaml is a valid config."""
from pathlib import Path

import yaml

from dare_core.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _has(tree: dict, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_stage_param_is_in_params_yaml_and_it_loads():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert list(stages) == ["inputs", "prepare", "sft", "preference", "rl", "convert", "eval"]
    for name, stage in stages.items():
        # training stages resume their checkpoints, or (params changed) set them aside and start fresh
        training = name in ("sft", "preference", "rl")
        assert stage["cmd"] == f"dare stage {name}" + (" --restart-if-changed" if training else "")
        for p in stage.get("params", []):
            assert _has(params, p), f"dvc.yaml stage '{name}' tracks '{p}', which params.yaml lacks"
    load_config(REPO / "params.yaml")
