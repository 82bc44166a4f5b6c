"""Tokenizers in the Hugging Face on-disk layout, and the tiny char-level tokenizer of the embedded task.

A folder holds `tokenizer.json` (the `tokenizers` model), `tokenizer_config.json` (special tokens and
the chat template) and `special_tokens_map.json`; that is what `PreTrainedTokenizerFast` reads, so a
model trained here can be published and loaded by `transformers` without conversion.
"""
from __future__ import annotations

import functools
import json
import string
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from dare_core.storage import atomic_dir

PathLike = Union[str, Path]

BOS, EOS, MASK = "<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
# The special tokens of LLaDA-8B-Instruct, so code written against one works with the other.
SPECIAL_TOKENS = (BOS, EOS, START_HEADER, END_HEADER, EOT, MASK)
# Names that other checkpoints use for "end of turn" / "mask", looked up when the config is silent.
_EOT_CANDIDATES = (EOT, "<|im_end|>")
_MASK_CANDIDATES = (MASK, "<|mask|>")

# The embedded task's own template: as short as possible, because every character is a token and
# the model is tiny. Single-turn: bos, the user message, end of turn; the answer follows directly.
COMPACT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
)
# transformers' VERY_LARGE_INTEGER, as LLaDA writes it: the model config, not the tokenizer, is the limit.
_UNLIMITED = int(1e30)
# Printable ASCII except the whitespace a chat prompt never needs (tab, CR, VT, FF).
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def _token_content(value: Any) -> Optional[str]:
    # HF configs store a special token either as a string or as a serialised AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A `tokenizers.Tokenizer` plus its HF config: specials, chat template, encode/decode."""

    def __init__(self, backend: _HFTokenizer, config: dict, model_config: Optional[dict] = None) -> None:
        self.backend = backend
        self.config = config
        self.bos_token_id = self._id_of_config("bos_token")
        self.eos_token_id = self._id_of_config("eos_token")
        if self.eos_token_id is None:
            raise ValueError("tokenizer config has no usable eos_token")
        pad = self._id_of_config("pad_token")
        # LLaDA pads with EOS; a tokenizer without a pad token follows that convention.
        self.pad_token_id = self.eos_token_id if pad is None else pad
        self.mask_token_id = self._resolve_mask(model_config or {})
        self.eot_token_id = self._first_known(_EOT_CANDIDATES)
        if self.pad_token_id == self.mask_token_id:
            # Padding would be indistinguishable from positions the model must predict.
            raise ValueError(f"pad token id == mask token id ({self.mask_token_id}); they must differ")

    # ---- special tokens
    def _id_of_config(self, key: str) -> Optional[int]:
        content = _token_content(self.config.get(key))
        return None if content is None else self.backend.token_to_id(content)

    def _first_known(self, names: Sequence[str]) -> Optional[int]:
        for name in names:
            tid = self.backend.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def _resolve_mask(self, model_config: dict) -> int:
        # LLaDA's tokenizer_config has no mask_token; its config.json carries mask_token_id.
        tid = self._id_of_config("mask_token")
        if tid is None:
            tid = model_config.get("mask_token_id")
        if tid is None:
            tid = self._first_known(_MASK_CANDIDATES)
        if tid is None:
            raise ValueError("cannot find a mask token (tokenizer_config mask_token, config.json "
                             f"mask_token_id, or one of {list(_MASK_CANDIDATES)})")
        return int(tid)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> set[int]:
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id,
                               self.mask_token_id, self.eot_token_id) if i is not None)
        return ids

    # ---- text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; never adds bos/eos (the chat template places bos)."""
        try:
            return self.backend.encode(text, add_special_tokens=False).ids
        except Exception as exc:  # tokenizers raises a bare Exception for out-of-vocabulary chars
            unknown = sorted({c for c in text if self.backend.token_to_id(c) is None})
            raise ValueError(f"cannot encode text: characters not in the vocabulary: {unknown} ({exc})") from exc

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        template = self.config.get("chat_template")
        if not template:
            raise ValueError("tokenizer config has no chat_template")
        return _render(template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=_token_content(self.config.get("bos_token")) or "",
                       eos_token=_token_content(self.config.get("eos_token")) or "")

    # ---- disk
    def save(self, folder: PathLike) -> None:
        """Write the HF layout into `folder`, replacing it in one rename."""
        with atomic_dir(folder) as tmp:
            (tmp / "tokenizer.json").write_text(self.backend.to_str(pretty=True))
            (tmp / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")
            special_map = _special_tokens_map(self.config)
            (tmp / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Compiling costs ~4 ms; prepare renders tens of thousands of prompts with one template.
    # Same environment as transformers' apply_chat_template, so templates render identically.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _render(template: str, **variables: Any) -> str:
    return _compile(template).render(**variables)


def _special_tokens_map(config: dict) -> dict:
    keys = ("bos_token", "eos_token", "pad_token", "mask_token", "additional_special_tokens")
    return {k: config[k] for k in keys if config.get(k) is not None}


def char_tokenizer() -> Tokenizer:
    """The embedded task's tokenizer, in memory: one id per printable ASCII char, then LLaDA's specials."""
    vocab = {c: i for i, c in enumerate(CHARS)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    backend = _HFTokenizer(models.WordLevel(vocab))
    # Every character is its own word (`[\s\S]` rather than `.`, which would skip newlines).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens with nothing in between (the default decoder would insert spaces).
    backend.decoder = decoders.Fuse()
    # Registered as added tokens so a literal "<|eot_id|>" in text is one token, not ten chars.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    added = {
        str(backend.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [START_HEADER, END_HEADER, EOT],
        "bos_token": BOS,
        "chat_template": COMPACT_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "mask_token": MASK,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": _UNLIMITED,
        "pad_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return Tokenizer(backend, config)


def build_char_tokenizer(folder: PathLike) -> Tokenizer:
    """Build the char-level tokenizer and save it in HF layout into `folder` (atomically)."""
    tok = char_tokenizer()
    tok.save(folder)
    return tok


def load_tokenizer(folder: PathLike) -> Tokenizer:
    """Load a HF tokenizer folder (tokenizer.json + tokenizer_config.json; config.json optional)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder not found: {folder}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"tokenizer file not found: {folder / name}")
    backend = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    model_config_path = folder / "config.json"
    model_config = json.loads(model_config_path.read_text()) if model_config_path.is_file() else None
    return Tokenizer(backend, config, model_config)
