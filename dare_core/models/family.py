"""Model families by `model_type`: what differs between LLaDA, Dream, SDAR and LLaDA2 (config
mapping, parameter names, attention pattern, logit alignment, and the facts other layers ask of a
family: evaluation sampler defaults and label, rollout engines, tokenizer class names); everything
else is the shared transformer. Each family file registers itself; importing `dare_core.models`
imports them all, and evaluation, engines and the tokenizer loader read the registry, so a new
family is its model file alone."""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from dare_core.errors import ConfigError, ModelLoadError
from dare_core.models.transformer import TransformerConfig
from dare_core.registry import Registry

FAMILIES = Registry("model_type", error=ModelLoadError)


@dataclass
class Family:
    """What differs between model families; everything else is the shared transformer."""

    model_type: str
    config_from_hf: Callable[[dict], TransformerConfig]
    # (generic name template, checkpoint name template) pairs; `{i}` is the layer, `{e}` the expert index
    name_map: list[tuple[str, str]]
    shift_logits: bool = False
    # block diffusion: attention is block-causal with this default block size (config.json's
    # `block_size_key` overrides it); None means fully bidirectional (masked diffusion)
    block_size: Optional[int] = None
    block_size_key: str = "block_size"
    # where a block-diffusion family's blocks sit: on multiples of the block size from position 0
    # (SDAR, LLaDA2: the first decoded block holds the prompt's tail) or from the end of the prompt
    # (DiffusionGemma: every canvas is whole)
    blocks_at_prompt_end: bool = False
    # the corruption the family is trained with: "masked" (a mask token) or "uniform" (random tokens
    # of the vocabulary; no mask token: DiffusionGemma)
    noise: str = "masked"
    # the network of the family's config (None: the shared transformer)
    network: Optional[Callable[[object], object]] = None
    # checkpoint tensors that are not loaded (a vision tower, an encoder's tied copies of weights)
    ignored: Optional[re.Pattern] = None
    # (vocab_size, mask_id, eos_id, pad_id, **sizes) -> config.json dict of a from-scratch model
    tiny_config: Optional[Callable[..., dict]] = None
    # a family whose model_type is shared by another layout picks it from the config (LLaDA-MoE
    # says model_type "llada" like LLaDA-8B): config -> the Family that really applies
    variant: Optional[Callable[[dict], "Family"]] = None
    # config.json keys holding special token ids (a dotted key reads a nested object: "text_config.eos_token_id")
    token_id_keys: dict = field(default_factory=lambda: {"mask": "mask_token_id", "eos": "eos_token_id", "pad": "pad_token_id"})
    # the family's published special ids ("mask"/"eos" -> id), for a config that leaves them out and a
    # folder whose tokenizer files do not name them (SDAR-30B-A3B's and LLaDA2's config.json carry
    # no mask id; LLaDA2's no eos id either)
    default_token_ids: dict[str, int] = field(default_factory=dict)
    # evaluation: the sampler settings the family's papers evaluate with (below a checkpoint's own),
    # and the label of its OpenCompass model class (`Dare<label>`; families sharing a label share it)
    sampler_defaults: dict = field(default_factory=dict)
    eval_label: Optional[str] = None
    # the engines that decode only the families naming them here (their `check` reads this; each
    # reads the model's own mask id from config.json: lmdeploy's SDAR builder hard-codes the
    # released one, and DARE's engine makes it read config.json's, sampling/engines/lmdeploy/child.py);
    # one that decodes every family, as the native loop does, is named by none
    engines: tuple[str, ...] = ()
    # words of a `tokenizer_class` whose vocab.json + merges.txt are Qwen2's byte-level BPE
    tokenizer_class_words: tuple[str, ...] = ()

    def with_default_token_ids(self, hf_config: dict) -> dict:
        """A copy of `hf_config` with each special id it lacks (absent or null) set to the family's."""
        out = dict(hf_config)
        for role, token_id in self.default_token_ids.items():
            key = self.token_id_keys[role]
            if config_value(out, key) is None:
                *parents, last = key.split(".")
                node = out
                for part in parents:  # (copied on the way down: the caller's dict stays as it is)
                    node[part] = dict(node.get(part) or {})
                    node = node[part]
                node[last] = token_id
        return out

    def token_ids(self, hf_config: dict) -> dict:
        """role ("mask", "eos", "pad") -> its id in `hf_config` (None where absent)."""
        return {role: config_value(hf_config, key) for role, key in self.token_id_keys.items()}

    def check_init(self, init: dict) -> None:
        """ConfigError unless every key of `model.init` is a setting of this family's from-scratch
        config.json: the mapping is free-form, and a typo (n_layer) would otherwise be one more key
        that nothing reads, the model silently built with the default."""
        if self.tiny_config is None:
            return
        known = self.tiny_config(8, 7, 6)
        known = {**known, **known.get("text_config", {})}  # (a composite config's sizes live in its text model's)
        for key in init:
            if key not in known:
                close = difflib.get_close_matches(str(key), list(known), n=1)
                hint = f"; did you mean model.init.{close[0]}?" if close else f" (family {self.model_type})"
                raise ConfigError(f"unknown setting model.init.{key}{hint}")

    def to_hf_name(self, name: str) -> str:
        return translate_name(name, self.name_map, 0, 1, self.model_type)

    def from_hf_name(self, name: str) -> str:
        return translate_name(name, self.name_map, 1, 0, self.model_type)


def noise_of(model) -> str:
    """The noise `model` is trained with (`Family.noise`); "masked" for a model without a family (a test double)."""
    return getattr(getattr(model, "family", None), "noise", "masked")


def config_value(hf_config: dict, key: str):
    """hf_config[key], a dotted key ("text_config.eos_token_id") read through nested objects; None if absent."""
    value = hf_config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _template_regex(template: str) -> re.Pattern:
    """"layers.{i}.mlp.experts.{e}.up_proj.weight" -> a regex with one numeric group per field."""
    return re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>\\d+)", re.escape(template)))


def translate_name(name: str, name_map: list[tuple[str, str]], src: int, dst: int, model_type: str) -> str:
    """`name` by the pair of `name_map` whose side `src` matches it, written as its side `dst`; KeyError if none does."""
    for pair in name_map:
        m = _template_regex(pair[src]).fullmatch(name)
        if m:
            return pair[dst].format(**m.groupdict())
    raise KeyError(f"{model_type}: no mapping for parameter '{name}'")


def register_family(family: Family) -> Family:
    return FAMILIES.register(family.model_type)(family)


def get_family(model_type: str) -> Family:
    return FAMILIES.lookup(model_type)


def own_families() -> list[Family]:
    """Each family registered under its own model_type (not under an alias such as `llada_moe`,
    which config.json never names), in registration order."""
    return [f for name, f in FAMILIES.items() if name == f.model_type]


def family_of(hf_config: dict) -> Family:
    family = get_family(hf_config.get("model_type", "<missing>"))
    return family.variant(hf_config) if family.variant is not None else family
