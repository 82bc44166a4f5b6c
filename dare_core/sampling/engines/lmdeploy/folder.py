"""The model folder lmdeploy is pointed at (docs/sampling.md#engines): a view of the checkpoint
whose config.json carries every field lmdeploy's SDAR code reads, with the values DARE's own model
uses, and no remote code.

lmdeploy reads config.json and tokenizer_config.json through transformers' Auto classes. A released
SDAR folder's `auto_map` names modules (configuration_sdar.py, tokenization_qwen2.py) that a folder
DARE saved does not hold (DARE never copies model code), so the view drops it; transformers then
reads the config as a bare `PreTrainedConfig`, which has only the file's own keys. Under
transformers 5 such a config has no `pad_token_id` (lmdeploy's SDAR model reads it) and a
`rope_parameters` of None (lmdeploy's rotary embedding reads its `rope_theta`, and would fall back to
10,000 where SDAR uses 1,000,000 if the key were present without it), and DARE's own small configs
leave out keys lmdeploy reads directly (`sliding_window`, ...). The view writes each one, with the
default DARE's model takes when the key is absent (`models/qwen.py`), and the model's mask id, which
the engine's process makes lmdeploy use instead of the released checkpoints' hard-coded one.
"""
from __future__ import annotations

import json
from pathlib import Path

from dare_core.models.family import own_families

ENGINE = "lmdeploy"
# the files through which transformers' Auto* classes import a checkpoint's own code (their auto_map)
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")
# keys lmdeploy's SDAR / SDAR-MoE code reads as attributes, with the value DARE's model takes when
# config.json leaves them out (models/qwen.py, models/sdar.py)
DEFAULTS = {"attention_bias": False, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
            "sliding_window": None, "rope_theta": 10000.0}
MOE_DEFAULTS = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


def engine_config(config: dict, mask_token_id: int, pad_token_id: int) -> dict:
    """config.json as lmdeploy must read it (see the module docstring)."""
    if config.get("rope_scaling"):  # DARE's model refuses it too (models/qwen.py)
        raise ValueError(f"rope_scaling={config['rope_scaling']!r} is not supported")
    out = {k: v for k, v in config.items() if k != "auto_map"}
    for key, value in (DEFAULTS | (MOE_DEFAULTS if "num_experts" in config else {})).items():
        out.setdefault(key, value)
    out["num_key_value_heads"] = config.get("num_key_value_heads") or config["num_attention_heads"]
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(out["rope_theta"])}
    if out.get("pad_token_id") is None:
        out["pad_token_id"] = int(pad_token_id)
    out["mask_token_id"] = int(mask_token_id)
    return out


def served_folder(model_path: Path, view: Path, mask_token_id: int, pad_token_id: int) -> Path:
    """`view`: links to `model_path`'s files (weights are never copied), with config.json from
    `engine_config` and tokenizer_config.json without its auto_map."""
    view.mkdir(parents=True)
    for f in Path(model_path).iterdir():
        if f.name in REMOTE_CODE_FILES:
            data = json.loads(f.read_text())
            data = engine_config(data, mask_token_id, pad_token_id) if f.name == "config.json" else data
            data.pop("auto_map", None)
            (view / f.name).write_text(json.dumps(data, indent=2))
        elif f.suffix != ".py":
            (view / f.name).symlink_to(f.resolve())
    return view


def check_model(model) -> None:
    """Only the families that say lmdeploy decodes them (`Family.engines`), as block diffusion."""
    served = [f for f in own_families() if ENGINE in f.engines]
    if model.block_size is None or model.family.model_type not in {f.model_type for f in served}:
        labels = "/".join(dict.fromkeys(f.eval_label for f in served))
        raise ValueError(f"the lmdeploy engine decodes {labels} models ({tuple(f.model_type for f in served)}), "
                         f"not '{model.family.model_type}'")
