"""Every reference checkpoint's real config, built on the meta device, yields exactly the parameter
names of its model.safetensors.index.json, with the shapes that add up to the index's total size."""
import json
from pathlib import Path

import pytest
import torch

from dare_core.models.registry import build_model, tokenizer_token_ids

REF = Path(__file__).resolve().parents[4] / "shared" / "reference" / "checkpoints"
FOLDERS = ["LLaDA-8B-Instruct", "Dream-v0-Instruct-7B", "SDAR-1dot7B-Chat", "SDAR-4B-Chat", "SDAR-8B-Chat",
           "SDAR-30B-A3B-Chat", "LLaDA2.0-mini", "LLaDA2.1-mini"]
# LLaDA2's reference folder lacks tokenizer.json, where its mask id lives: give any id for the meta build
FALLBACK_IDS = {"mask_token_id": 1, "eos_token_id": 0, "pad_token_id": 0}


def _meta_model(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    for key, value in {**FALLBACK_IDS, **tokenizer_token_ids(folder)}.items():
        config.setdefault(key, value)
        if config[key] is None:
            config[key] = value
    return config, build_model(config, device="meta")


@pytest.mark.skipif(not REF.exists(), reason="reference checkpoints not present")
@pytest.mark.parametrize("name", FOLDERS)
def test_parameter_names_and_sizes_match_the_real_index(name):
    folder = REF / name
    config, model = _meta_model(folder)
    shapes = model.hf_parameter_shapes()
    index_path = folder / "model.safetensors.index.json"
    if not index_path.exists():  # SDAR-1.7B ships one safetensors file and no index
        pytest.skip(f"{name} has no index file")
    index = json.loads(index_path.read_text())
    names = set(index["weight_map"])
    assert set(shapes) == names, (sorted(set(shapes) - names)[:5], sorted(names - set(shapes))[:5])
    n_bytes = 2 * sum(torch.Size(s).numel() for s in shapes.values())
    # LLaDA2.1 keeps its expert bias in float32: two more bytes per element
    fp32_extra = sum(torch.Size(s).numel() for k, s in shapes.items() if k.endswith("expert_bias")) * 2
    assert index["metadata"]["total_size"] in (n_bytes, n_bytes + fp32_extra)


@pytest.mark.skipif(not REF.exists(), reason="reference checkpoints not present")
def test_special_token_ids_come_from_the_checkpoint():
    assert _meta_model(REF / "LLaDA-8B-Instruct")[1].mask_token_id == 126336
    assert _meta_model(REF / "Dream-v0-Instruct-7B")[1].mask_token_id == 151666
    assert _meta_model(REF / "SDAR-8B-Chat")[1].mask_token_id == 151669
    sdar_moe = _meta_model(REF / "SDAR-30B-A3B-Chat")[1]
    assert sdar_moe.mask_token_id == 151669 and sdar_moe.eos_token_id == 151643  # config has no mask id: tokenizer files
    assert _meta_model(REF / "Dream-v0-Instruct-7B")[1].family.shift_logits
    assert _meta_model(REF / "SDAR-8B-Chat")[1].block_size == 4
    assert _meta_model(REF / "LLaDA2.0-mini")[1].block_size == 32
