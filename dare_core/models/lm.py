"""`DiffusionLM`: a family-configured transformer with its checkpoint config and special token ids;
the one model class every stage trains, samples and exports."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch
import torch.nn as nn

from dare_core.errors import ModelLoadError
from dare_core.models.family import Family, family_of
from dare_core.models.transformer import KVCache, Transformer, default_position_ids
from dare_core.models.ulysses import SequenceShards


@dataclass
class ScoredStream:
    """What a scoring forward runs, and which of its hidden states the scores read: the token
    stream (a padded batch, one packed row, the two-stream [x_t ; x_0] layout), its positions and
    its mask, all of the whole stream, and per scored position the flat index r * T + t of the
    hidden state that predicts it (row-major over the scored positions)."""

    ids: torch.Tensor  # [R, T]
    positions: torch.Tensor  # [R, T]
    attn: object  # boolean mask broadcastable to [R, H, T, T], or an AttentionContext
    sources: torch.Tensor  # long [N]


class DiffusionLM(nn.Module):
    """A family-configured transformer plus the checkpoint's config and special token ids."""

    def __init__(self, family: Family, hf_config: dict):
        super().__init__()
        self.family = family
        self.hf_config = family.with_default_token_ids(hf_config)
        self.config = family.config_from_hf(hf_config)
        # training forwards over real tokens only: auto | on | off (dare_core/models/packing.py)
        self.packing = "off"
        # scored tokens per chunk of the logits-free scoring path; 0 = whole [N, V] logits (model.logits_chunk)
        self.logits_chunk = 0
        # this rank's place in its sequence-parallel group (launch.sequence_parallel > 1): the training
        # scores (diffusion/likelihood.py) then run this rank's slice of every stream only; rollouts never
        self.sequence_shards: Optional[SequenceShards] = None
        ids = family.token_ids(self.hf_config)
        # (None in a uniform-noise family, which has no mask token)
        self.mask_token_id: Optional[int] = ids.get("mask")
        self.eos_token_id: int = ids["eos"]
        self.pad_token_id: int = ids["pad"] if ids["pad"] is not None else ids["eos"]
        if self.mask_token_id is None and family.noise == "masked":
            raise ModelLoadError(f"{family.model_type}: no mask token id in the config ('{family.token_id_keys['mask']}'), "
                                 "the tokenizer files or the family's defaults")
        if self.pad_token_id == self.mask_token_id and family.noise == "masked":
            raise ModelLoadError("pad token id equals the mask token id; padding would be read as noise")
        for role, value in (("mask", self.mask_token_id), ("eos", self.eos_token_id), ("pad", self.pad_token_id)):
            # an id past the embedding table fails as an index error in the first forward, after
            # the stage has written its outputs
            ids_given = value if isinstance(value, (list, tuple)) else [value]  # (some configs list several EOS)
            if value is not None and any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.config.vocab_size
                                         for v in ids_given):
                raise ModelLoadError(f"{family.token_id_keys.get(role, role + '_token_id')} {value!r} is not a token id "
                                     f"of the vocabulary (0 to {self.config.vocab_size - 1})")
        self.net = family.network(self.config) if family.network is not None else Transformer(self.config)

    @property
    def max_sequence_length(self) -> int:
        return self.config.max_sequence_length

    @property
    def block_size(self) -> Optional[int]:
        if self.family.block_size is None:
            return None
        return int(self.hf_config.get(self.family.block_size_key) or self.family.block_size)

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
        position i predicting token i: the output head over `scored_hidden`."""
        return self.net.lm_head(self.scored_hidden(input_ids, attention_mask, rows))

    def scored_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, d] whose output-head projection predicts the tokens at the real
        positions in the boolean [B, S] `rows` (row-major order; a shifted family's come from the
        column before): what training scores. Under `self.packing` the forward runs over the real
        tokens only (`dare_core.models.packing`), else over the padded batch."""
        return self.stream_hidden(self.scored_stream(input_ids, attention_mask, rows))

    def stream_hidden(self, stream: ScoredStream) -> torch.Tensor:
        """The hidden states [N, d] at `stream.sources`, from one forward over the whole stream."""
        hidden = self.net.hidden_states(stream.ids, None, stream.positions, stream.attn)
        return hidden.flatten(0, 1)[stream.sources]

    def scored_stream(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor) -> ScoredStream:
        """The `ScoredStream` of `scored_hidden`: the padded batch under the family's pattern, or
        under `self.packing` its real tokens packed into one row."""
        from dare_core.models.attention import key_padding_mask, packed_context
        from dare_core.models.packing import PackedLayout, packed_backend

        backend = packed_backend(self.packing, input_ids.device, self.block_size is not None)
        if backend is None:
            pos = default_position_ids(input_ids, attention_mask)
            mask = (block_causal_mask(pos, self.block_size, attention_mask) if self.block_size is not None
                    else key_padding_mask(attention_mask))
            return ScoredStream(input_ids, pos, mask, self.flat_sources(rows, attention_mask, input_ids.shape[1]))
        layout = PackedLayout.of(attention_mask)
        ctx = packed_context(layout.lens, backend, input_ids.device, self.block_size, layout.positions)
        return ScoredStream(input_ids[layout.valid][None], layout.positions[None], ctx, layout.sources(rows, self.family.shift_logits))

    def flat_sources(self, rows: torch.Tensor, attention_mask: Optional[torch.Tensor], width: int) -> torch.Tensor:
        """Flat index b * width + j of the output position predicting each position of the boolean
        [B, S] `rows` (row-major) in a padded forward of rows `width` wide: what `hidden_at` reads."""
        b, i = rows.nonzero(as_tuple=True)
        src = self._shift_source(b, i, attention_mask) if self.family.shift_logits else i
        return b * width + src

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

    def hidden_at(self, hidden: torch.Tensor, rows: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The hidden states [N, d] predicting the positions in the boolean [B, S] `rows`, in row-major order."""
        if not self.family.shift_logits:
            return hidden[rows]
        b, i = rows.nonzero(as_tuple=True)
        return hidden[b, self._shift_source(b, i, attention_mask)]

    def logits_at(self, hidden: torch.Tensor, rows: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits for the positions in the boolean [B, S] `rows`, in row-major order."""
        return self.net.lm_head(self.hidden_at(hidden, rows, attention_mask))

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


class _NoDefaultInit(torch.overrides.TorchFunctionMode):
    """torch.nn.init calls (the modules' default inits) return their tensor untouched. For a model
    built on the meta device: its tensors hold no values, yet each init would run one of torch's
    Python meta kernels, the first of which imports torch._dynamo (about 3 s of CPU per process, in
    every command that only inspects, converts or loads a checkpoint)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build_model(hf_config: dict, device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None) -> DiffusionLM:
    family = family_of(hf_config)
    meta = torch.device(device).type == "meta"
    with torch.device(device), (_NoDefaultInit() if meta else contextlib.nullcontext()):
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
