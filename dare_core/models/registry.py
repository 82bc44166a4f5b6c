"""Model families by `model_type`, and loading/saving in the Hugging Face on-disk layout.

A family maps a real config.json onto the shared `TransformerConfig` and the real parameter names
onto the shared module tree. `load_model(folder)` works on a downloaded checkpoint folder as it is:
no remote code, no copied model files.
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dare_core.models.transformer import KVCache, Transformer, TransformerConfig, default_position_ids
from dare_core.registry import Registry
from dare_core.storage import atomic_dir, read_json


class ModelLoadError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and the parameter."""


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
        self.hf_config = dict(hf_config)
        self.config = family.config_from_hf(hf_config)
        self.net = Transformer(self.config)
        ids = {k: hf_config.get(v) for k, v in family.token_id_keys.items()}
        self.mask_token_id: int = ids["mask"]
        self.eos_token_id: int = ids["eos"]
        self.pad_token_id: int = ids["pad"] if ids["pad"] is not None else ids["eos"]
        if self.mask_token_id is None:
            raise ModelLoadError(f"{family.model_type}: config has no mask token id ('{family.token_id_keys['mask']}')")
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
    ) -> torch.Tensor:
        """Hidden states of the canvas columns `cols` (ascending, contiguous), whose tokens are
        `window_ids`, attending to the canvas keys [0, key_end) under the family's pattern.

        With a `KVCache` the window's keys/values are written into it and the other keys come from it;
        without one the window must be the keys themselves (cols = 0..key_end-1)."""
        if cache is None and (cols.numel() != key_end or int(cols[0]) != 0):
            raise ValueError("without a KV cache the window must cover columns 0..key_end-1")
        mask = attention_mask[:, None, None, :key_end].bool()
        pos = position_ids[:, cols]
        if self.block_size is not None:
            q_block = pos // self.block_size
            k_block = position_ids[:, :key_end] // self.block_size
            mask = mask & (k_block[:, None, None, :] <= q_block[:, None, :, None])
        return self.net.hidden_states(window_ids, None, pos, mask, kv_cache=cache.window(cols, key_end) if cache is not None else None)

    def column_logits(self, hidden: torch.Tensor, window_start: int, lo: int, hi: int) -> torch.Tensor:
        """Logits [B, hi-lo, V] predicting canvas columns [lo, hi) from the hidden states of a window
        that starts at `window_start` (a shifted family reads column c from hidden c-1, so its window
        must start before lo)."""
        shift = 1 if self.family.shift_logits else 0
        a = lo - shift - window_start
        if a < 0:
            raise ValueError(f"window starting at column {window_start} cannot predict column {lo}")
        return self.net.lm_head(hidden[:, a:a + hi - lo])

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

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors: parameters and persistent buffers (e.g. an expert bias); a tied
        head is stored once, as the embedding."""
        if getattr(self, "lora", None) is not None:  # export folds the adapter into the weights
            from dare_core.models.lora import merged_state_dict

            state = merged_state_dict(self)
        else:
            state = self.net.state_dict()
        if self.config.tie_embeddings:
            state.pop("lm_head.weight", None)
        return {self.family.to_hf_name(k): v for k, v in state.items()}

    def hf_parameter_shapes(self) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in self.hf_state_dict().items()}

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


def _read_config(folder: Path) -> dict:
    if not folder.exists():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder}: not a model folder (a file, not a directory)")
    path = folder / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{path}: missing (not a model folder?)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


@contextlib.contextmanager
def _open_shard(path: Path) -> Iterator[Any]:
    """safe_open, with a truncated or corrupt file named (safetensors' own error names no file)."""
    try:
        handle = safe_open(path, "pt", device="cpu")
    except SafetensorError as exc:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({exc}); truncated or corrupt?") from exc
    with handle as f:
        yield f


def _weight_files(folder: Path) -> dict[str, str]:
    """hf parameter name -> shard file name."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no 'weight_map' object")
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).exists():
                missing = sorted(k for k, v in weight_map.items() if v == shard)
                raise ModelLoadError(f"{folder / shard}: shard listed in {index.name} is missing (holds e.g. '{missing[0]}')")
        return weight_map
    single = folder / "model.safetensors"
    if not single.exists():
        raise ModelLoadError(f"{folder}: neither model.safetensors.index.json nor model.safetensors found")
    with _open_shard(single) as f:
        return {k: single.name for k in f.keys()}


MASK_TOKENS = ("<|mdm_mask|>", "<|mask|>", "<|MASK|>", "<MASK>")


def _token_content(value: Any) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value


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
        for content in list(MASK_TOKENS) + [_token_content(tok_cfg.get("eos_token")), _token_content(tok_cfg.get("pad_token"))]:
            if content in vocab:
                ids.setdefault(content, int(vocab[content]))
    found = {}
    mask = _token_content(tok_cfg.get("mask_token"))
    for name in ([mask] if mask else []) + list(MASK_TOKENS):
        if name in ids:
            found["mask_token_id"] = ids[name]
            break
    for key in ("eos", "pad"):
        content = _token_content(tok_cfg.get(f"{key}_token"))
        if content in ids:
            found[f"{key}_token_id"] = ids[content]
    return found


def _json_or_empty(path: Path) -> dict:
    return read_json(path) if path.exists() else {}


def _open_folder(folder: Path) -> tuple[DiffusionLM, dict[str, str]]:
    """The model on the meta device and its parameter -> shard map, with every check that needs no
    weights: config.json, the family, the parameter names, every shard present with a sound header."""
    hf_config = _read_config(folder)
    for key, value in tokenizer_token_ids(folder).items():
        if hf_config.get(key) is None:
            hf_config[key] = value
    model = build_model(hf_config, device="meta")
    expected = model.hf_parameter_shapes()
    weight_map = _weight_files(folder)
    missing = sorted(set(expected) - set(weight_map))
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks parameter '{missing[0]}' ({len(missing)} missing)")
    unexpected = sorted(set(weight_map) - set(expected))
    if unexpected:
        raise ModelLoadError(f"{folder / weight_map[unexpected[0]]}: unexpected parameter '{unexpected[0]}' for {hf_config.get('model_type')}")
    for shard in sorted(set(weight_map.values())):
        with _open_shard(folder / shard):  # headers only: a truncated shard fails here, before any load
            pass
    return model, weight_map


def inspect_model(folder: Union[str, Path]) -> DiffusionLM:
    """A checkpoint folder checked as far as possible without reading its weights; the model is on
    the meta device (shapes, family, special ids and max_sequence_length, no memory)."""
    return _open_folder(Path(folder))[0]


def load_model(folder: Union[str, Path], dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu") -> DiffusionLM:
    """Load a Hugging Face checkpoint folder (config.json + safetensors) into our stack."""
    folder = Path(folder)
    model, weight_map = _open_folder(folder)
    expected = model.hf_parameter_shapes()
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        with _open_shard(folder / shard) as f:
            for hf_name in f.keys():
                t = f.get_tensor(hf_name)
                if tuple(t.shape) != expected[hf_name]:
                    raise ModelLoadError(f"{folder / shard}: parameter '{hf_name}' has shape {tuple(t.shape)}, config implies {expected[hf_name]}")
                # a fresh (64-byte aligned) buffer: kernels may round differently on misaligned data,
                # and a reload must reproduce the saved model's logits bit for bit
                state[model.family.from_hf_name(hf_name)] = t.clone()
    if model.config.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.net.load_state_dict(state, assign=True, strict=True)
    if model.config.tie_embeddings:
        model.net.lm_head.weight = model.net.embed.weight
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)


def save_model(
    model: DiffusionLM,
    folder: Union[str, Path],
    max_shard_bytes: int = 2 * 1024**3,
    extra_files: Optional[dict[str, Any]] = None,
    sampler: Optional[dict] = None,
) -> Path:
    """Write config.json + sharded safetensors + index atomically (the folder appears complete or not at all)."""
    folder = Path(folder)
    state = {k: v.detach().contiguous().cpu() for k, v in model.hf_state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    config = dict(model.hf_config)
    config["torch_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    with atomic_dir(folder) as tmp:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        gen_cfg = {k: config[k] for k in ("eos_token_id", "pad_token_id") if k in config}
        if sampler:  # how this checkpoint is meant to be decoded (read back by `dare generate`/`dare eval`)
            gen_cfg["dare_sampler"] = sampler
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
        for name, content in (extra_files or {}).items():
            src = Path(content) if isinstance(content, (str, Path)) else None
            if src is not None and src.is_dir():
                for f in src.iterdir():
                    if f.is_file():
                        (tmp / f.name).write_bytes(f.read_bytes())
            elif src is not None:
                (tmp / name).write_bytes(src.read_bytes())
    return folder
