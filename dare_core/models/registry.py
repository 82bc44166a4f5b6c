"""Model families by `model_type`, and loading/saving in the Hugging Face on-disk layout.

A family maps a real config.json onto the shared `TransformerConfig` and the real parameter names
onto the shared module tree. `load_model(folder)` works on a downloaded checkpoint folder as it is:
no remote code, no copied model files.
"""
from __future__ import annotations

import contextlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from dare_core.errors import ModelLoadError
from dare_core.models.safetensors_io import SHARD_BYTES, nbytes, plan_shards, write_shard
from dare_core.models.tokenizer import MASK_CANDIDATES, TOKENIZER_FILES, token_content
from dare_core.models.transformer import KVCache, Transformer, TransformerConfig, default_position_ids
from dare_core.registry import Registry
from dare_core.storage import atomic_dir, read_json

FAMILIES = Registry("model_type", error=ModelLoadError)


@dataclass
class Family:
    """What differs between model families; everything else is the shared transformer."""

    model_type: str
    config_from_hf: Callable[[dict], TransformerConfig]
    # (generic name template, checkpoint name template) pairs; `{i}` is the layer, `{e}` the expert index
    name_map: list[tuple[str, str]]
    shift_logits: bool = False
    # block diffusion: attention is block-causal with this default block size (config "block_size"
    # overrides it); None means fully bidirectional (masked diffusion)
    block_size: Optional[int] = None
    # (vocab_size, mask_id, eos_id, pad_id, **sizes) -> config.json dict of a from-scratch model
    tiny_config: Optional[Callable[..., dict]] = None
    # a family whose model_type is shared by another layout picks it from the config (LLaDA-MoE
    # says model_type "llada" like LLaDA-8B): config -> the Family that really applies
    variant: Optional[Callable[[dict], "Family"]] = None
    # config.json keys holding special token ids
    token_id_keys: dict = field(default_factory=lambda: {"mask": "mask_token_id", "eos": "eos_token_id", "pad": "pad_token_id"})
    # the family's published special ids ("mask"/"eos" -> id), for a config that leaves them out and a
    # folder whose tokenizer files do not name them (SDAR-30B-A3B's and LLaDA2's config.json carry
    # no mask id; LLaDA2's no eos id either)
    default_token_ids: dict[str, int] = field(default_factory=dict)

    def with_default_token_ids(self, hf_config: dict) -> dict:
        """A copy of `hf_config` with each special id it lacks (absent or null) set to the family's."""
        out = dict(hf_config)
        for role, token_id in self.default_token_ids.items():
            if out.get(self.token_id_keys[role]) is None:
                out[self.token_id_keys[role]] = token_id
        return out

    def to_hf_name(self, name: str) -> str:
        return _translate(name, self.name_map, 0, 1, self.model_type)

    def from_hf_name(self, name: str) -> str:
        return _translate(name, self.name_map, 1, 0, self.model_type)


def _template_regex(template: str) -> re.Pattern:
    """"layers.{i}.mlp.experts.{e}.up_proj.weight" -> a regex with one numeric group per field."""
    return re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>\\d+)", re.escape(template)))


def _translate(name: str, name_map: list[tuple[str, str]], src: int, dst: int, model_type: str) -> str:
    for pair in name_map:
        m = _template_regex(pair[src]).fullmatch(name)
        if m:
            return pair[dst].format(**m.groupdict())
    raise KeyError(f"{model_type}: no mapping for parameter '{name}'")


def register_family(family: Family) -> Family:
    return FAMILIES.register(family.model_type)(family)


def get_family(model_type: str) -> Family:
    _import_families()
    return FAMILIES.lookup(model_type)


def family_of(hf_config: dict) -> Family:
    family = get_family(hf_config.get("model_type", "<missing>"))
    return family.variant(hf_config) if family.variant is not None else family


def _import_families() -> None:
    from dare_core.models import dream, llada, llada2, sdar  # noqa: F401  (they register themselves)


class DiffusionLM(nn.Module):
    """A family-configured transformer plus the checkpoint's config and special token ids."""

    def __init__(self, family: Family, hf_config: dict):
        super().__init__()
        self.family = family
        self.hf_config = family.with_default_token_ids(hf_config)
        self.config = family.config_from_hf(hf_config)
        self.net = Transformer(self.config)
        # training forwards over real tokens only: auto | on | off (dare_core/models/packing.py)
        self.packing = "off"
        ids = {k: self.hf_config.get(v) for k, v in family.token_id_keys.items()}
        self.mask_token_id: int = ids["mask"]
        self.eos_token_id: int = ids["eos"]
        self.pad_token_id: int = ids["pad"] if ids["pad"] is not None else ids["eos"]
        if self.mask_token_id is None:
            raise ModelLoadError(f"{family.model_type}: no mask token id in the config ('{family.token_id_keys['mask']}'), "
                                 "the tokenizer files or the family's defaults")
        if self.pad_token_id == self.mask_token_id:
            raise ModelLoadError("pad token id equals the mask token id; padding would be read as noise")

    @property
    def max_sequence_length(self) -> int:
        return self.config.max_sequence_length

    @property
    def block_size(self) -> Optional[int]:
        if self.family.block_size is None:
            return None
        return int(self.hf_config.get("block_size") or self.family.block_size)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Final hidden states under the family's attention pattern (bidirectional or block-causal)."""
        if position_ids is None:
            position_ids = default_position_ids(input_ids, attention_mask)
        if attn_mask is None and self.block_size is not None:
            attn_mask = block_causal_mask(position_ids, self.block_size, attention_mask)
        return self.net.hidden_states(input_ids, attention_mask, position_ids, attn_mask)

    def window_hidden(
        self,
        window_ids: torch.Tensor,
        cols: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        key_end: int,
        cache: Optional[KVCache] = None,
        compiled: bool = False,
    ) -> torch.Tensor:
        """Hidden states of the canvas columns `cols` (ascending, contiguous), whose tokens are
        `window_ids`, attending to the canvas keys [0, key_end) under the family's pattern.

        With a `KVCache` the window's keys/values are written into it and the other keys come from it
        (`compiled`: through the compiled layer call); without one the window must be the keys
        themselves (cols = 0..key_end-1)."""
        if cache is None and (cols.numel() != key_end or int(cols[0]) != 0):
            raise ValueError("without a KV cache the window must cover columns 0..key_end-1")
        mask = attention_mask[:, None, None, :key_end].bool()
        pos = position_ids[:, cols]
        if self.block_size is not None:
            q_block = pos // self.block_size
            k_block = position_ids[:, :key_end] // self.block_size
            mask = mask & (k_block[:, None, None, :] <= q_block[:, None, :, None])
        return self.net.hidden_states(window_ids, None, pos, mask, kv_cache=cache.window(cols, key_end) if cache is not None else None,
                                      compiled_layers=compiled)

    def column_logits(self, hidden: torch.Tensor, window_start: int, lo: int, hi: int) -> torch.Tensor:
        """Logits [B, hi-lo, V] predicting canvas columns [lo, hi) from the hidden states of a window
        that starts at `window_start` (a shifted family reads column c from hidden c-1, so its window
        must start before lo)."""
        shift = 1 if self.family.shift_logits else 0
        a = lo - shift - window_start
        if a < 0:
            raise ValueError(f"window starting at column {window_start} cannot predict column {lo}")
        return self.net.lm_head(hidden[:, a:a + hi - lo])

    def scored_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] for the real positions in the boolean [B, S] `rows` (row-major order),
        position i predicting token i: what training scores. Under `self.packing` the forward runs
        over the real tokens only (`dare_core.models.packing`), else over the padded batch."""
        from dare_core.models.packing import PackedLayout, packed_backend

        backend = packed_backend(self.packing, input_ids.device, self.block_size is not None)
        if backend is None:
            return self.logits_at(self.hidden_states(input_ids, attention_mask), rows, attention_mask)
        from dare_core.models.attention import packed_context

        layout = PackedLayout.of(attention_mask)
        ctx = packed_context(layout.lens, backend, input_ids.device, self.block_size, layout.positions)
        hidden = self.net.hidden_states(input_ids[layout.valid][None], None, layout.positions[None], ctx)[0]
        return self.net.lm_head(hidden[layout.sources(rows, self.family.shift_logits)])

    def forward_packed(self, input_ids: torch.Tensor, seq_lens: list[int], backend: str = "sdpa") -> torch.Tensor:
        """Logits [T, V] of sequences packed back to back in the 1-D `input_ids` (no padding);
        positions restart at 0 per sequence and no token attends across sequences."""
        from dare_core.models.attention import packed_context

        lens = torch.tensor(seq_lens, device=input_ids.device)
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(input_ids.numel(), device=input_ids.device) - torch.repeat_interleave(starts, lens)
        ctx = packed_context(seq_lens, backend, input_ids.device, self.block_size, pos)
        hidden = self.net.hidden_states(input_ids[None], None, pos[None], ctx)[0]
        if self.family.shift_logits:  # i-1 inside each sequence; a sequence's first token reads itself
            i = torch.arange(input_ids.numel(), device=input_ids.device)
            hidden = hidden[torch.where(pos == 0, i, i - 1)]
        return self.net.lm_head(hidden)

    def _shift_source(self, b: torch.Tensor, i: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Output position holding the prediction for (b, i) in a shifted family: i-1, except a
        sample's first real token (after any left padding), which reads its own output."""
        src = (i - 1).clamp_min(0)
        if attention_mask is not None:
            first_real = attention_mask.long().argmax(-1)
            src = torch.where(i == first_real[b], i, src)
        return src

    def logits_at(self, hidden: torch.Tensor, rows: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits for the positions in the boolean [B, S] `rows`, in row-major order."""
        if not self.family.shift_logits:
            return self.net.lm_head(hidden[rows])
        b, i = rows.nonzero(as_tuple=True)
        return self.net.lm_head(hidden[b, self._shift_source(b, i, attention_mask)])

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits aligned so that position i predicts token i (shifted families are re-aligned here)."""
        logits = self.net.lm_head(self.hidden_states(input_ids, attention_mask, position_ids, attn_mask))
        if not self.family.shift_logits:
            return logits
        bsz, seq = input_ids.shape
        b = torch.arange(bsz, device=input_ids.device)[:, None].expand(bsz, seq)
        i = torch.arange(seq, device=input_ids.device)[None].expand(bsz, seq)
        src = self._shift_source(b, i, attention_mask)
        return logits.gather(1, src[..., None].expand(-1, -1, logits.shape[-1]))

    def _export_entries(self) -> Iterator[tuple[str, torch.Tensor, Optional[nn.Module]]]:
        """(generic name, stored tensor, its LoRA layer or None), in state-dict order; a tied head is
        left out (stored once, as the embedding). References only: nothing is computed."""
        if getattr(self, "lora", None) is not None:
            from dare_core.models.lora import base_tensors

            entries = base_tensors(self.net)
        else:
            entries = ((k, v, None) for k, v in self.net.state_dict().items())
        for name, tensor, layer in entries:
            if not (self.config.tie_embeddings and name == "lm_head.weight"):
                yield name, tensor, layer

    def hf_layout(self) -> dict[str, tuple[tuple, torch.dtype]]:
        """Checkpoint name -> (shape, dtype) of every exported tensor, in export order, computing
        nothing (a LoRA-merged weight has its base weight's shape and dtype)."""
        return {self.family.to_hf_name(k): (tuple(v.shape), v.dtype) for k, v, _ in self._export_entries()}

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) one at a time, in `hf_layout` order: parameters and persistent
        buffers (e.g. an expert bias), each adapted weight merged with its LoRA adapter as it is
        reached, on the device the weights are on."""
        from dare_core.models.lora import fold

        for name, tensor, layer in self._export_entries():
            yield self.family.to_hf_name(name), fold(tensor, layer) if layer is not None else tensor.detach()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors, all at once (LoRA merged); `hf_tensors` streams them."""
        return dict(self.hf_tensors())

    def hf_parameter_shapes(self) -> dict[str, tuple]:
        return {k: shape for k, (shape, _) in self.hf_layout().items()}

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        self.net.gradient_checkpointing = enabled


def block_causal_mask(position_ids: torch.Tensor, block_size: int, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, 1, S, S] bool: query i sees key j iff block(j) <= block(i), blocks counted from each
    sample's own position 0 (so left padding does not shift them); padding keys are never seen."""
    block = position_ids // block_size
    mask = block[:, None, None, :] <= block[:, None, :, None]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    return mask


def build_model(hf_config: dict, device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None) -> DiffusionLM:
    family = family_of(hf_config)
    with torch.device(device):
        model = DiffusionLM(family, hf_config)
    if dtype is not None:
        model = model.to(dtype)
    return model


def empty_model(hf_config: dict, device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None) -> DiffusionLM:
    """The model with its tensors allocated on `device` (floating ones in `dtype`) and left
    uninitialised, for a caller that sets every one (`Transformer.init_weights`): no default init
    is computed and nothing is allocated anywhere else first."""
    model = build_model(hf_config, device="meta")
    if dtype is not None:
        model = model.to(dtype)  # on meta: free
    model.to_empty(device=device)
    if model.config.tie_embeddings:  # to_empty gives each module its own new tensor: tie again
        model.net.lm_head.weight = model.net.embed.weight
    return model


INDEX = "model.safetensors.index.json"


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
    weight_map = _weight_files(folder)
    missing = sorted(set(layout) - set(weight_map))
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks parameter '{missing[0]}' ({len(missing)} missing)")
    unexpected = sorted(set(weight_map) - set(layout))
    if unexpected:
        raise ModelLoadError(f"{folder / weight_map[unexpected[0]]}: unexpected parameter '{unexpected[0]}' for {hf_config.get('model_type')}")
    for shard, names in _by_shard(weight_map).items():
        _check_header(folder / shard, names, layout, weight_map)
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
    with atomic_dir(folder) as tmp:
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
