"""Tokenizers in the Hugging Face on-disk layout, and the tiny char-level tokenizer of the embedded task.

A folder holds `tokenizer.json` (the `tokenizers` model), `tokenizer_config.json` (special tokens and
the chat template) and `special_tokens_map.json`; that is what `PreTrainedTokenizerFast` reads, so a
model trained here can be published and loaded by `transformers` without conversion.

Checkpoints published with the slow-tokenizer layout instead (Dream, SDAR: Qwen2 byte-level BPE as
`vocab.json` + `merges.txt`, the added tokens in `tokenizer_config.json`, the chat template there or in
`chat_template.jinja`) are loaded too, by building the same `tokenizers` pipeline that transformers'
`Qwen2Tokenizer` builds; no remote code (`auto_map`) is ever imported.
"""
from __future__ import annotations

import datetime
import functools
import json
import string
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from dare_core.models.family import FAMILIES
from dare_core.storage import atomic_dir, read_json

PathLike = Union[str, Path]

BOS, EOS, MASK = "<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
# The special tokens of LLaDA-8B-Instruct, so code written against one works with the other.
SPECIAL_TOKENS = (BOS, EOS, START_HEADER, END_HEADER, EOT, MASK)
# Names that other checkpoints use for "end of turn" / "mask", looked up when the config is silent.
_EOT_CANDIDATES = (EOT, "<|im_end|>")
MASK_CANDIDATES = (MASK, "<|mask|>", "<|MASK|>", "<MASK>")
# What a checkpoint folder holds of its tokenizer, in either layout (copied into exports; never the
# weights, config.json or the index that share the folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "tokenizer.model")
# The named special tokens that transformers passes to a chat template (its `special_tokens_map`).
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' Qwen2Tokenizer pre-tokenizer split (tokenization_qwen2.PRETOKENIZE_REGEX).
_QWEN2_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Message fields that carry reasoning; transformers copies whichever is set into `reasoning_content`
# (and `thinking`) before rendering, so templates reading either name see it.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# The embedded task's own template: as short as possible, because every character is a token and
# the model is tiny. Single-turn: bos, the user message, end of turn; the answer follows directly.
COMPACT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
)
# transformers' VERY_LARGE_INTEGER, as LLaDA writes it: the model config, not the tokenizer, is the limit.
_UNLIMITED = int(1e30)
# Printable ASCII except the whitespace a chat prompt never needs (tab, CR, VT, FF).
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def token_content(value: Any) -> Optional[str]:
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
        content = token_content(self.config.get(key))
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
            tid = self._first_known(MASK_CANDIDATES)
        if tid is None:
            raise ValueError("cannot find a mask token (tokenizer_config mask_token, config.json "
                             f"mask_token_id, or one of {list(MASK_CANDIDATES)})")
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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: Optional[list[dict]] = None, documents: Optional[list[dict]] = None,
                            **template_kwargs: Any) -> str:
        """Render `messages` with the config's chat template, as transformers' `apply_chat_template(
        tokenize=False)` does: the named special tokens, `tools`, `documents` and any extra keyword
        (e.g. `enable_thinking=False`) are visible to the template."""
        template = self.config.get("chat_template")
        if not template:
            raise ValueError("tokenizer config has no chat_template")
        if not isinstance(template, str):
            # The list-of-named-templates form: the one called "default" is the chat template.
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if not template:
                raise ValueError(f"tokenizer config has no default chat template (named: {sorted(map(str, named))})")
        specials = {k: token_content(self.config.get(k)) for k in _NAMED_SPECIALS}
        variables = {k: v for k, v in specials.items() if v is not None}
        variables.update(template_kwargs)
        return _render(template, messages=_alias_reasoning_fields(messages), tools=tools, documents=documents,
                       add_generation_prompt=add_generation_prompt, **variables)

    # ---- disk
    def save(self, folder: PathLike) -> None:
        """Write the HF layout into `folder`, replacing it in one rename."""
        with atomic_dir(folder, writes=TOKENIZER_FILES) as tmp:
            (tmp / "tokenizer.json").write_text(self.backend.to_str(pretty=True))
            (tmp / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")
            special_map = _special_tokens_map(self.config)
            (tmp / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def _alias_reasoning_fields(messages: list[dict]) -> list[dict]:
    out = []
    for message in messages:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateNamespace(jinja2.utils.Namespace):
    # As transformers': no underscore-prefixed attributes, so a template cannot reach CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _TemplateDict:
    # `dict(...)` in a template, without exposing the type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' (and so every template's) does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Compiling costs ~4 ms; prepare renders tens of thousands of prompts with one template.
    # Same environment as transformers' apply_chat_template (utils/chat_template_utils.py), so
    # templates render identically: sandbox, trim/lstrip blocks, loop controls, the generation tag,
    # and the globals and filters it gives templates.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
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
    """Load a HF tokenizer folder, as downloaded; never runs remote code.

    The model is `tokenizer.json` when present, else Qwen2 byte-level BPE from `vocab.json` +
    `merges.txt` with the added tokens of `tokenizer_config.json` at their recorded ids. The chat
    template is `chat_template.jinja` when present (transformers gives it priority), else the config's
    `chat_template`. `config.json` (optional) supplies `mask_token_id` when the tokenizer config has none.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder not found: {folder}")
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {config_path}")
    config = read_json(config_path)
    if (folder / "tokenizer.json").is_file():
        backend = _read_backend(folder / "tokenizer.json")
    elif (folder / "vocab.json").is_file() or (folder / "merges.txt").is_file():
        for name in ("vocab.json", "merges.txt"):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"tokenizer file not found: {folder / name} (vocab.json and merges.txt "
                                        "go together; or provide tokenizer.json)")
        backend = _qwen2_byte_level_bpe(folder, config)
    else:
        raise FileNotFoundError(f"no tokenizer model in {folder}: need tokenizer.json, or vocab.json + merges.txt "
                                "(only the tokenizer config is there)")
    template_path = folder / "chat_template.jinja"
    if template_path.is_file():
        try:
            config = {**config, "chat_template": template_path.read_text(encoding="utf-8")}
        except UnicodeDecodeError as exc:
            raise ValueError(f"{template_path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    model_config_path = folder / "config.json"
    model_config = read_json(model_config_path) if model_config_path.is_file() else None
    return Tokenizer(backend, config, model_config)


def _read_backend(path: Path) -> _HFTokenizer:
    try:
        return _HFTokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception that names no file
        raise ValueError(f"{path}: not a readable tokenizer file ({exc})") from exc


def _special_contents(config: dict) -> set[str]:
    """Contents of every special token the config names (transformers marks these special)."""
    names = {token_content(config.get(k)) for k in _NAMED_SPECIALS}
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        values = extra.values() if isinstance(extra, dict) else extra
        names.update(token_content(v) for v in values)
    names.discard(None)
    return names


def _qwen2_byte_level_bpe(folder: Path, config: dict) -> _HFTokenizer:
    """The `tokenizers` pipeline of transformers' `Qwen2Tokenizer`, from vocab.json + merges.txt, plus
    the added tokens of the config, each at the id the config records."""
    cls = config.get("tokenizer_class")
    # Qwen2's own class, or one of a family that ships Qwen2's vocabulary under its own name
    words = ("Qwen2", *(w for family in FAMILIES.values() for w in family.tokenizer_class_words))
    if cls is not None and not any(k in cls for k in words):
        raise ValueError(f"{folder}: vocab.json + merges.txt are read as Qwen2 byte-level BPE, but "
                         f"tokenizer_class is {cls!r}; provide tokenizer.json")
    try:
        vocab, merges = models.BPE.read_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    except Exception as exc:  # a bare Exception from the tokenizers library
        raise ValueError(f"{folder / 'vocab.json'} + merges.txt: not a readable BPE vocabulary ({exc})") from exc
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                      continuing_subword_prefix="", end_of_word_suffix="",
                                      fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    _add_recorded_tokens(backend, folder, config)
    return backend


def _add_recorded_tokens(backend: _HFTokenizer, folder: Path, config: dict) -> None:
    specials = _special_contents(config)
    recorded = config.get("added_tokens_decoder")
    if recorded:
        entries = sorted((int(i), dict(e)) for i, e in recorded.items())
    elif (folder / "added_tokens.json").is_file():
        # Older layout: content -> id only; the flags follow the config's special tokens.
        table = read_json(folder / "added_tokens.json")
        entries = sorted((int(i), {"content": c}) for c, i in table.items())
    else:
        entries = []
    for tid, entry in entries:
        content = entry["content"]
        special = bool(entry.get("special", False)) or content in specials
        token = AddedToken(content, special=special, normalized=bool(entry.get("normalized", not special)),
                           lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                           single_word=bool(entry.get("single_word", False)))
        before = backend.get_vocab_size(with_added_tokens=True)
        backend.add_tokens([token])
        got = backend.token_to_id(content)
        if got != tid:
            raise ValueError(f"{folder}: added token {content!r} got id {got} but the tokenizer config records "
                             f"{tid} (the vocabulary had {before} ids); the added tokens do not fit vocab.json")
