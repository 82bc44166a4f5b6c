"""A damaged model folder fails with a ModelLoadError that names the file and the parameter, before
any weight is read where the headers tell; a folder whose config.json and tokenizer files leave out a
special id gets the family's published one."""
import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dare_core.errors import ModelLoadError, UserError
from dare_core.models import hf_folder
from dare_core.models.hf_folder import inspect_model, load_model, save_model
from dare_core.models.lm import build_model
from tiny_models import EOS, tiny

REF = Path(__file__).resolve().parents[4] / "shared" / "reference" / "checkpoints"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    # several shards, so that damage to one is found among sound ones
    return save_model(tiny("sdar"), tmp_path_factory.mktemp("saved") / "m", max_shard_bytes=20_000)


@pytest.fixture
def folder(saved, tmp_path) -> Path:
    """A fresh copy of the saved folder, to damage."""
    copy = tmp_path / "m"
    copy.mkdir()
    for f in saved.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def _second_shard(folder: Path) -> Path:
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    return shards[1]


def _rewrite(shard: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard)


def _raises(folder: Path, *fragments: str, read: Callable = load_model) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        read(folder)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert isinstance(info.value, UserError)  # printed as one line, without a traceback
    return info.value


# ---- one test per damage -------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [4, 20, -100], ids=["header-length-cut", "header-cut", "data-cut"])
@pytest.mark.parametrize("read", [load_model, inspect_model], ids=["load", "inspect"])
def test_truncated_shard(folder, keep, read):
    shard = _second_shard(folder)
    shard.write_bytes(shard.read_bytes()[:keep])
    err = _raises(folder, str(shard), "not a readable safetensors file", "truncated", read=read)
    assert isinstance(err.__cause__, SafetensorError)


def test_shard_lacking_a_tensor_the_index_places_there(folder):
    shard = _second_shard(folder)
    name = sorted(load_file(shard))[0]
    _rewrite(shard, lambda t: t.pop(name))
    _raises(folder, str(shard), f"lacks parameter '{name}'", "the index places it in this file", read=inspect_model)


def test_shard_holding_a_tensor_the_index_does_not_list(folder):
    shard = _second_shard(folder)
    _rewrite(shard, lambda t: t.update(foo=torch.zeros(3)))
    _raises(folder, str(shard), "holds 'foo'", f"which {INDEX} does not list", read=inspect_model)


@pytest.mark.parametrize("name", [INDEX, "config.json"])
def test_truncated_json_file(folder, name):
    path = folder / name
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    err = _raises(folder, str(path), "invalid JSON")
    assert isinstance(err.__cause__, json.JSONDecodeError)


@pytest.mark.parametrize("name", [INDEX, "config.json"])
def test_json_file_that_is_not_an_object(folder, name):
    (folder / name).write_text("[1, 2]")
    _raises(folder, str(folder / name), "expected a JSON object, got list")


def test_index_naming_a_shard_that_does_not_exist(folder):
    index = json.loads((folder / INDEX).read_text())
    name = sorted(index["weight_map"])[3]
    index["weight_map"][name] = "model-00009-of-00009.safetensors"
    (folder / INDEX).write_text(json.dumps(index))
    _raises(folder, str(folder / "model-00009-of-00009.safetensors"), f"shard listed in {INDEX} is missing", f"'{name}'")


def test_tensor_of_the_wrong_shape(folder):
    shard = _second_shard(folder)
    name = next(k for k, v in sorted(load_file(shard).items()) if v.dim() == 2)
    _rewrite(shard, lambda t: t.update({name: t[name].reshape(-1)}))
    _raises(folder, str(shard), f"parameter '{name}' has shape", "config implies", read=inspect_model)


def test_tensor_of_an_integer_dtype(folder):
    shard = _second_shard(folder)
    name = sorted(load_file(shard))[0]
    _rewrite(shard, lambda t: t.update({name: t[name].to(torch.int32)}))
    _raises(folder, str(shard), f"parameter '{name}' is stored as I32", "floating-point", read=inspect_model)


def test_config_lacking_a_field(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    err = _raises(folder, str(folder / "config.json"), "lacks 'hidden_size'", "'sdar' config")
    assert isinstance(err.__cause__, KeyError)


def test_error_in_a_reader_thread_is_a_model_load_error(folder, monkeypatch):
    """Damage that only reading finds (here: the header check skipped) fails in a reader thread
    and reaches the caller as the ModelLoadError raised there."""
    monkeypatch.setattr(hf_folder, "_check_header", lambda *args: None)
    shard = _second_shard(folder)
    name = sorted(load_file(shard))[0]
    _rewrite(shard, lambda t: t.pop(name))
    err = _raises(folder, str(shard), f"cannot read parameter '{name}'")
    assert isinstance(err.__cause__, SafetensorError)


# ---- the family's special ids where config.json and the tokenizer files have none ----------------

# (model type, config keys the real config.json leaves out, mask id, eos id: the family's where
# dropped, else the tiny config's own)
FAMILY_IDS = [("sdar_moe", ["mask_token_id"], 151669, EOS),
              ("llada2_moe", ["mask_token_id", "eos_token_id"], 156895, 156892)]


# a vocabulary that holds the family ids below: a special id must be a token id of the model
FAMILY_VOCAB = 156_904


def _without_ids(model_type: str, dropped: list[str], tmp_path: Path) -> Path:
    folder = save_model(tiny(model_type, vocab=FAMILY_VOCAB), tmp_path / model_type)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in dropped}))
    assert not list(folder.glob("tokenizer*")) and not (folder / "added_tokens.json").exists()
    return folder


@pytest.mark.parametrize("model_type, dropped, mask_id, eos_id", FAMILY_IDS)
def test_folder_without_tokenizer_gets_the_family_ids(tmp_path, model_type, dropped, mask_id, eos_id):
    folder = _without_ids(model_type, dropped, tmp_path)
    for model in (inspect_model(folder), load_model(folder)):
        assert (model.mask_token_id, model.eos_token_id) == (mask_id, eos_id)
        # an export then states them in its config.json
        assert (model.hf_config["mask_token_id"], model.hf_config["eos_token_id"]) == (mask_id, eos_id)


def test_tokenizer_files_win_over_the_family_ids(tmp_path):
    folder = _without_ids("sdar_moe", ["mask_token_id"], tmp_path)
    entry = {"content": "<|MASK|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<|MASK|>", "added_tokens_decoder": {"61": entry}}))
    assert inspect_model(folder).mask_token_id == 61


@pytest.mark.skipif(not REF.exists(), reason="reference checkpoints not present")
@pytest.mark.parametrize("name, mask_id, eos_id", [("SDAR-30B-A3B-Chat", 151669, 151643), ("LLaDA2.0-mini", 156895, 156892),
                                                    ("LLaDA2.1-mini", 156895, 156892)])
def test_real_configs_without_a_mask_id_get_the_family_ids(name, mask_id, eos_id):
    config = json.loads((REF / name / "config.json").read_text())
    assert config.get("mask_token_id") is None
    model = build_model(config, device="meta")  # as from a folder without tokenizer files
    assert (model.mask_token_id, model.eos_token_id) == (mask_id, eos_id)
    # the family's ids are the ones the real tokenizer files give, where they give any
    from_tokenizer = hf_folder.tokenizer_token_ids(REF / name)
    assert from_tokenizer.get("mask_token_id", mask_id) == mask_id and from_tokenizer.get("eos_token_id", eos_id) == eos_id
