"""Loading and saving a model in the Hugging Face on-disk layout. `load_model(folder)` works on a
downloaded checkpoint folder as it is: no remote code, no copied model files."""
from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from dare_core.errors import ModelLoadError
from dare_core.models.family import Family
from dare_core.models.lm import DiffusionLM, build_model
from dare_core.models.safetensors_io import SHARD_BYTES, nbytes, plan_shards, write_shard
from dare_core.models.tokenizer import MASK_CANDIDATES, TOKENIZER_FILES, token_content
from dare_core.storage import atomic_dir, read_json


INDEX = "model.safetensors.index.json"
# what `save_model` writes into a folder (an unmarked folder holding only these is an earlier export: ownership.py)
EXPORT_FILES = ("config.json", "generation_config.json", INDEX, "model-*-of-*.safetensors", *TOKENIZER_FILES)


def _read_json_object(path: Path) -> dict:
    """A JSON object file of a model folder; unreadable, not JSON or not an object names the file."""
    value = read_json(path, error=ModelLoadError)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_config(folder: Path) -> dict:
    if not folder.exists():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder}: not a model folder (a file, not a directory)")
    path = folder / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{path}: missing (not a model folder?)")
    return _read_json_object(path)


@contextlib.contextmanager
def _open_shard(path: Path, device: Union[str, torch.device] = "cpu") -> Iterator[Any]:
    """safe_open, with a truncated, corrupt or unreadable file named (safetensors' own error names no file)."""
    try:
        handle = safe_open(path, "pt", device=str(device))
    except SafetensorError as exc:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({exc}); truncated or corrupt?") from exc
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot open ({exc.strerror or exc})") from exc
    with handle as f:
        yield f


def _weight_files(folder: Path) -> dict[str, str]:
    """hf parameter name -> shard file name."""
    index = folder / INDEX
    if index.exists():
        weight_map = _index_weight_map(index)
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                missing = sorted(k for k, v in weight_map.items() if v == shard)
                raise ModelLoadError(f"{folder / shard}: shard listed in {index.name} is missing (holds e.g. '{missing[0]}')")
        return weight_map
    single = folder / "model.safetensors"
    if not single.exists():
        raise ModelLoadError(f"{folder}: neither {INDEX} nor model.safetensors found")
    with _open_shard(single) as f:
        return {k: single.name for k in f.keys()}


def _index_weight_map(index: Path) -> dict[str, str]:
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(f"{index}: no 'weight_map' object (tensor name -> shard file name)")
    return weight_map


def tokenizer_token_ids(folder: Path) -> dict[str, int]:
    """mask/eos/pad ids from a folder's tokenizer files, for configs that do not carry them
    (LLaDA2's config.json has neither mask nor eos id)."""
    tok_cfg = _json_or_empty(folder / "tokenizer_config.json")
    ids: dict[str, int] = {}
    for entry_id, entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
        ids[entry["content"]] = int(entry_id)
    tok_json = _json_or_empty(folder / "tokenizer.json")
    for entry in tok_json.get("added_tokens") or []:
        ids.setdefault(entry["content"], int(entry["id"]))
    vocab = (tok_json.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for content in list(MASK_CANDIDATES) + [token_content(tok_cfg.get("eos_token")), token_content(tok_cfg.get("pad_token"))]:
            if content in vocab:
                ids.setdefault(content, int(vocab[content]))
    found = {}
    mask = token_content(tok_cfg.get("mask_token"))
    for name in ([mask] if mask else []) + list(MASK_CANDIDATES):
        if name in ids:
            found["mask_token_id"] = ids[name]
            break
    for key in ("eos", "pad"):
        content = token_content(tok_cfg.get(f"{key}_token"))
        if content in ids:
            found[f"{key}_token_id"] = ids[content]
    return found


def _json_or_empty(path: Path) -> dict:
    return _read_json_object(path) if path.exists() else {}


def _open_folder(folder: Path) -> tuple[DiffusionLM, dict[str, str]]:
    """The model on the meta device and its parameter -> shard map, with every check that needs no
    weights: config.json, the family, the parameter names, every shard present with a sound header."""
    hf_config = _read_config(folder)
    for key, value in tokenizer_token_ids(folder).items():
        if hf_config.get(key) is None:
            hf_config[key] = value
    model = _meta_model(folder / "config.json", hf_config)
    layout = model.hf_layout()
    listed = _weight_files(folder)
    ignored = model.family.ignored
    weight_map = {k: v for k, v in listed.items() if ignored is None or not ignored.match(k)}  # (never read)
    missing = sorted(set(layout) - set(weight_map))
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks parameter '{missing[0]}' ({len(missing)} missing)")
    unexpected = sorted(set(weight_map) - set(layout))
    if unexpected:
        raise ModelLoadError(f"{folder / weight_map[unexpected[0]]}: unexpected parameter '{unexpected[0]}' for {hf_config.get('model_type')}")
    for shard, names in _by_shard(weight_map).items():
        _check_header(folder / shard, names, layout, listed)
    return model, weight_map


def _meta_model(config_path: Path, hf_config: dict) -> DiffusionLM:
    """The model on the meta device; a config field that is missing or that our stack does not
    support is reported against config.json (the family code names the field, not the file)."""
    try:
        return build_model(hf_config, device="meta")
    except KeyError as exc:
        raise ModelLoadError(f"{config_path}: lacks {exc}, which a '{hf_config.get('model_type')}' config needs") from exc
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from exc
    except (TypeError, ArithmeticError) as exc:
        # a family's own arithmetic on a field of the wrong type or a zero (hidden_size // heads)
        raise ModelLoadError(f"{config_path}: a field has a value of the wrong type or size "
                             f"({type(exc).__name__}: {exc})") from exc


def _by_shard(weight_map: dict[str, str]) -> dict[str, list[str]]:
    """shard file -> the parameter names the index places in it, shards in name order."""
    shards: dict[str, list[str]] = {}
    for name, shard in sorted(weight_map.items(), key=lambda item: item[1]):
        shards.setdefault(shard, []).append(name)
    return shards


def _check_header(path: Path, names: list[str], layout: dict[str, tuple[tuple, torch.dtype]], weight_map: dict[str, str]) -> None:
    """Headers only, so that a damaged folder fails before any weight is read: a truncated shard,
    a tensor the index places here but the file lacks, one the file holds but the index does not
    list, a shape or dtype the model cannot take."""
    with _open_shard(path) as f:
        present = set(f.keys())
        lacking = [name for name in names if name not in present]
        if lacking:
            raise ModelLoadError(f"{path}: lacks parameter '{lacking[0]}' (the index places it in this file)")
        # a tensor the index sends to another shard is harmless (that shard is read); one it does not
        # list at all means the index and the shards were written for different models
        unlisted = sorted(present - weight_map.keys())
        if unlisted:
            raise ModelLoadError(f"{path}: holds '{unlisted[0]}', which {INDEX} does not list ({len(unlisted)} unlisted)")
        for name in names:
            _check_tensor(path, name, f.get_slice(name), *layout[name])


def _check_tensor(path: Path, name: str, view: Any, shape: tuple, dtype: torch.dtype) -> None:
    stored_shape = tuple(view.get_shape())
    if stored_shape != shape:
        raise ModelLoadError(f"{path}: parameter '{name}' has shape {stored_shape}, config implies {shape}")
    # floating dtypes may differ (a load casts, and LLaDA2.1 keeps its expert bias in float32 beside
    # bf16 weights); an integer or bool tensor cannot become a parameter
    stored_dtype = view.get_dtype()
    if stored_dtype.startswith(("F", "BF")) != dtype.is_floating_point:
        want = "a floating-point tensor" if dtype.is_floating_point else str(dtype).removeprefix("torch.")
        raise ModelLoadError(f"{path}: parameter '{name}' is stored as {stored_dtype}; the model needs {want}")


def inspect_model(folder: Union[str, Path]) -> DiffusionLM:
    """A checkpoint folder checked as far as possible without reading its weights; the model is on
    the meta device (shapes, family, special ids and max_sequence_length, no memory)."""
    return _open_folder(Path(folder))[0]


def load_model(folder: Union[str, Path], dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu") -> DiffusionLM:
    """Load a Hugging Face checkpoint folder (config.json + safetensors) into our stack, on `device`,
    floating tensors in `dtype` (None: as stored).

    The model is built on the meta device and each tensor, read shard by shard straight onto
    `device` and cast there, becomes its parameter: no random init that the weights then overwrite,
    no float32 copy of the whole model on the host."""
    folder = Path(folder)
    device = _concrete(torch.device(device))
    model, weight_map = _open_folder(folder)
    state: dict[str, torch.Tensor] = {}
    shards = _by_shard(weight_map)
    # shards are read in parallel: one reader thread faults the memory-mapped file in page by page
    # and reaches a fraction of what an NVMe disk (or the page cache) delivers. A reader's
    # ModelLoadError is re-raised here by `pool.map`, as it is (its message names file and parameter)
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(shards))) as pool:
        parts = pool.map(lambda item: _read_shard(folder / item[0], item[1], model.family, dtype, device), shards.items())
        for part in parts:
            state.update(part)
    if model.config.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.net.load_state_dict(state, assign=True, strict=True)
    if model.config.tie_embeddings:
        model.net.lm_head.weight = model.net.embed.weight
    _check_materialised(model)
    return model


READ_THREADS = 4


def _concrete(device: torch.device) -> torch.device:
    """"cuda" -> "cuda:<current>", so that safetensors and torch agree on the GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _read_shard(path: Path, names: list[str], family: Family, dtype: Optional[torch.dtype], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors `names` of one shard, generic-named, read onto `device` and cast there."""
    out = {}
    with _open_shard(path, device) as f:
        for hf_name in names:
            try:
                t = f.get_tensor(hf_name)
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"{path}: cannot read parameter '{hf_name}' ({exc}); truncated or corrupt?") from exc
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            elif t.device.type == "cpu":
                # on the CPU safetensors hands out views of the memory-mapped file: take a fresh
                # (64-byte aligned) buffer, since kernels may round differently on misaligned data
                # and a reload must reproduce the saved model's logits bit for bit
                t = t.clone()
            out[family.from_hf_name(hf_name)] = t
    return out


def _check_materialised(model: nn.Module) -> None:
    """Nothing is left on the meta device: a buffer that no checkpoint holds would be (there is
    none today; one added later must be computed here, not silently left empty)."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise RuntimeError(f"load_model: '{name}' is not in the checkpoint and nothing computes it")


def save_model(
    model: DiffusionLM,
    folder: Union[str, Path],
    max_shard_bytes: int = SHARD_BYTES,
    extra_files: Optional[dict[str, Any]] = None,
    sampler: Optional[dict] = None,
    stats: Optional[dict] = None,
) -> Path:
    """Write config.json + safetensors shards (`model-0000k-of-0000n.safetensors`) + index.

    The folder is written under a temporary name and renamed into place, so it appears complete or
    not at all (a failure midway leaves `folder` as it was). Tensors are streamed in export order:
    each is taken from the model (a LoRA adapter merged on the device the weights are on) and written
    while the next is prepared, so the host holds a few tensors (of a GPU model, two 64 MiB chunks),
    never a copy of the model. `extra_files`: {name: file} copied in as `name`, or {name: folder}
    whose tokenizer files (`TOKENIZER_FILES`) are copied in. `stats`, when given, receives where the
    time went (`write_shard`'s produce_s, copy_s, disk_wait_s, other_s)."""
    folder = Path(folder)
    layout = model.hf_layout()
    shards = plan_shards(layout, max_shard_bytes)
    config = dict(model.hf_config)
    config["torch_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    with atomic_dir(folder, writes=EXPORT_FILES) as tmp:
        weight_map, times = {}, {}
        tensors = model.hf_tensors()
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            for key, seconds in write_shard(tmp / fname, [(name, *layout[name]) for name in names], tensors).items():
                times[key] = times.get(key, 0.0) + seconds
            weight_map.update({k: fname for k in names})
        total = sum(nbytes(shape, dtype) for shape, dtype in layout.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        gen_cfg = {k: config[k] for k in ("eos_token_id", "pad_token_id") if k in config}
        if sampler:  # how this checkpoint is meant to be decoded (read back by `dare generate`/`dare eval`)
            gen_cfg["dare_sampler"] = sampler
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
        for name, content in (extra_files or {}).items():
            src = Path(content) if isinstance(content, (str, Path)) else None
            if src is not None and src.is_dir():
                # a tokenizer folder is often the source checkpoint itself (`model.path`): its
                # tokenizer files only, never its weights, config or index over the ones just written
                for f in TOKENIZER_FILES:
                    if (src / f).is_file():
                        (tmp / f).write_bytes((src / f).read_bytes())
            elif src is not None:
                (tmp / name).write_bytes(src.read_bytes())
    if stats is not None:
        stats.update(times)
    return folder


def verify_saved(model: DiffusionLM, folder: Union[str, Path]) -> None:
    """Raise unless `folder` holds exactly `model`: its config gives the same architecture, family
    and special ids, and every tensor equals the model's (LoRA merged) bit for bit. Equal config and
    weights mean equal logits (load_model reproduces a saved model's logits bit for bit). Each stored
    tensor is read onto the device of the model's and compared there, one at a time: no second copy
    of the model, no forward, no trip of the model's weights to the host."""
    folder = Path(folder)
    saved, weight_map = _open_folder(folder)
    same = (saved.family is model.family and saved.config == model.config and saved.block_size == model.block_size
            and (saved.mask_token_id, saved.eos_token_id, saved.pad_token_id) == (model.mask_token_id, model.eos_token_id, model.pad_token_id))
    if not same:
        raise RuntimeError(f"{folder}: config.json does not describe the exported model")
    if set(weight_map) != set(model.hf_layout()):
        raise RuntimeError(f"{folder}: holds other tensors than the exported model")
    with contextlib.ExitStack() as stack:
        current, handle = None, None
        for name, tensor in model.hf_tensors():
            shard = weight_map[name]
            if shard != current:  # shards hold consecutive runs of tensors: one open at a time
                stack.close()
                current, handle = shard, stack.enter_context(_open_shard(folder / shard, _concrete(tensor.device)))
            stored = handle.get_tensor(name).to(tensor.device)
            if stored.dtype != tensor.dtype or not torch.equal(stored.reshape(-1).view(torch.uint8), tensor.detach().reshape(-1).view(torch.uint8)):
                raise RuntimeError(f"{folder / shard}: '{name}' differs from the exported model's")
