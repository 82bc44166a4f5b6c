"""What the prepared data was made from: the settings the prepare stage reads and the identity of its
input files, hashed into one digest that `summary.json` records (`made_from`).

`dvc repro` removes a stage's outputs before it runs the stage's command, so a prepare that refuses
its settings or data would leave the project without `data/prepared` and the tokenizer until they
are checked out again. The inputs stage, which DVC runs first, makes prepare's checks itself (a
dry run, nothing written) unless the prepared data on disk was made from exactly these settings and
inputs: prepare, which is deterministic in them, would then pass again.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from dare_core.config import DareConfig, to_dict
from dare_core.inputs import identities
from dare_core.storage import read_json

# the settings prepare reads: dvc.yaml's `params` of the prepare stage (tests/test_dvc_params.py)
PREPARE_SETTINGS = ("recipe", "lengths", "data", "model.path", "model.init", "sft.pad_to", "preference.pad_to",
                    "preference.enabled", "rl.sampler.gen_length", "rl.sampler.block_length", "rl.sampler.steps",
                    "eval.sampler.gen_length", "eval.sampler.block_length", "eval.sampler.steps", "rl.reward",
                    "rl.reward_args")


def _setting(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def made_from(cfg: DareConfig, found: Optional[dict] = None) -> str:
    """The digest of prepare's settings and its inputs' identities (`found`: inputs.identities(cfg),
    computed here when not given)."""
    tree = to_dict(cfg)
    record = {"settings": {key: _setting(tree, key) for key in PREPARE_SETTINGS},
              "inputs": identities(cfg) if found is None else found}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def prepared_summary(cfg: DareConfig) -> Optional[dict]:
    """The prepared data's summary.json, None where there is none (or it does not read as one)."""
    path = Path(cfg.data.prepared_dir) / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = read_json(path)
    except ValueError:  # a broken summary: prepare's own checks decide what it means
        return None
    return summary if isinstance(summary, dict) else None
