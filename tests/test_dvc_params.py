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
    assert list(stages) == ["input_file", "inputs", "prepare", "sft", "preference", "rl", "convert", "eval"]
    # one status-only stage per listed project input file (tests/dare_core/test_inputs.py runs it)
    assert stages.pop("input_file")["foreach"] == "${input_files}"
    for name, stage in stages.items():
        # training stages resume their checkpoints, or (params changed) set them aside and start fresh
        training = name in ("sft", "preference", "rl")
        assert stage["cmd"] == f"dare stage {name}" + (" --restart-if-changed" if training else "")
        for p in stage.get("params", []):
            assert _has(params, p), f"dvc.yaml stage '{name}' tracks '{p}', which params.yaml lacks"
    load_config(REPO / "params.yaml")


def test_every_input_setting_is_a_params_key_at_its_default_tracked_by_prepare():
    """Overrides (the flow's, `dvc exp run -S`) set only keys params.yaml has, so every input a
    stage reads (dare_core/inputs.py, and model.path) is there, at the config's default: the
    shipped pipeline runs as without the key. prepare reads them all, so DVC reruns it on a change."""
    from dare_core.config import DareConfig
    from dare_core.inputs import FILES

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    tracked = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["prepare"]["params"]
    defaults = DareConfig()
    for key in (*FILES, "model.path"):
        section, name = key.split(".")
        assert _has(params, key), f"params.yaml lacks {key}: an override cannot set it"
        assert params[section][name] == getattr(getattr(defaults, section), name), key
        assert any(key == p or key.startswith(p + ".") for p in tracked), f"prepare does not track {key}"


def test_what_the_prepared_data_was_made_from_is_what_dvc_reruns_prepare_on():
    """The inputs stage skips its dry run of prepare when the prepared data was made from the same
    settings (data/made_from.py): those must be exactly the ones DVC reruns prepare for."""
    from dare_core.data.made_from import PREPARE_SETTINGS

    tracked = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["prepare"]["params"]
    assert list(PREPARE_SETTINGS) == tracked


# settings a stage's config gets before it is fingerprinted (a recipe, `lengths: auto`): the
# fingerprint sees their effect, DVC must see the keys themselves
APPLIED_BEFORE_FINGERPRINT = ("recipe", "lengths")
# fingerprint entries computed from settings rather than copied: the params.yaml keys they come from
FINGERPRINT_SOURCES = {"world_size": "launch"}


def test_training_stage_params_agree_with_the_checkpoint_fingerprint():
    """DVC reruns a training stage on a change of its `params`; the stage resumes or restarts by its
    checkpoint fingerprint (training/checkpoint.py). Every fingerprint key must be a tracked param, or
    a change that restarts training would leave DVC's record stale; every tracked param must shape the
    fingerprint, or be applied before it."""
    from dare_core.config import DareConfig
    from dare_core.training.fingerprint import stage_fingerprint

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    cfg = DareConfig()
    cfg.launch.zero_stage, cfg.launch.offload_optimizer = 2, "cpu"  # keys recorded only when on
    for stage in ("sft", "preference", "rl"):
        tracked = stages[stage]["params"]
        keys = [FINGERPRINT_SOURCES.get(k, k) for k in stage_fingerprint(cfg, stage, {}).settings]
        untracked = [k for k in keys if not any(k == p or k.startswith(p + ".") for p in tracked)]
        assert not untracked, f"dvc.yaml stage '{stage}' does not track {untracked}, which its checkpoint fingerprint holds"
        unused = [p for p in tracked if p not in APPLIED_BEFORE_FINGERPRINT
                  and not any(k == p or k.startswith(p + ".") for k in keys)]
        assert not unused, f"dvc.yaml stage '{stage}' tracks {unused}, which its checkpoint fingerprint does not hold"
