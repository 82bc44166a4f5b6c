"""Every reference checkpoint's real config, built on the meta device, yields exactly the parameter
names of its model.safetensors.index.json, with the shapes that add up to the index's total size.
Configs and indexes: tests/reference; tokenizer files (ids a config lacks): ../shared."""
import pytest
import torch

from dare_core.models.hf_folder import tokenizer_token_ids
from dare_core.models.lm import build_model
from reference_metadata import CHECKPOINTS, NAMES, config, has_index, index, shared_checkpoint

# Mask/eos/pad ids a config lacks (LLaDA2 has neither mask nor eos id) come from tokenizer files;
# without them any ids do for a meta build: they change no parameter name or shape
FALLBACK_IDS = {"mask_token_id": 1, "eos_token_id": 0, "pad_token_id": 0}


def _meta_model(name: str, tokenizer_ids: dict = None):
    cfg = config(name)
    for key, value in {**FALLBACK_IDS, **(tokenizer_ids or {})}.items():
        cfg.setdefault(key, value)
        if cfg[key] is None:
            cfg[key] = value
    return cfg, build_model(cfg, device="meta")


def test_every_reference_checkpoint_is_kept():
    assert sorted(p.name for p in CHECKPOINTS.iterdir() if p.is_dir()) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_parameter_names_and_sizes_match_the_real_index(name):
    if not has_index(name):  # SDAR-1.7B ships one safetensors file and no index
        pytest.skip(f"{name} has no index file")
    _, model = _meta_model(name)
    shapes = model.hf_parameter_shapes()
    idx = index(name)
    names = set(idx["weight_map"])
    assert set(shapes) == names, (sorted(set(shapes) - names)[:5], sorted(names - set(shapes))[:5])
    n_bytes = 2 * sum(torch.Size(s).numel() for s in shapes.values())
    # LLaDA2.1 keeps its expert bias in float32: two more bytes per element
    fp32_extra = sum(torch.Size(s).numel() for k, s in shapes.items() if k.endswith("expert_bias")) * 2
    assert idx["metadata"]["total_size"] in (n_bytes, n_bytes + fp32_extra)


def test_special_token_ids_and_blocks_come_from_the_config():
    assert _meta_model("LLaDA-8B-Instruct")[1].mask_token_id == 126336
    assert _meta_model("Dream-v0-Instruct-7B")[1].mask_token_id == 151666
    assert _meta_model("SDAR-8B-Chat")[1].mask_token_id == 151669
    assert _meta_model("Dream-v0-Instruct-7B")[1].family.shift_logits
    assert _meta_model("SDAR-8B-Chat")[1].block_size == 4
    assert _meta_model("LLaDA2.0-mini")[1].block_size == 32


def test_special_token_ids_missing_from_the_config_come_from_the_tokenizer_files():
    name = "SDAR-30B-A3B-Chat"
    assert "mask_token_id" not in config(name)
    sdar_moe = _meta_model(name, tokenizer_token_ids(shared_checkpoint(name)))[1]
    assert sdar_moe.mask_token_id == 151669 and sdar_moe.eos_token_id == 151643
