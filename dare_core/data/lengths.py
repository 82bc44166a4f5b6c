"""Lengths derived from the data: `auto` canvases, sampler lengths and a from-scratch model's length.

`sft.pad_to`, `preference.pad_to` and the `gen_length` / `block_length` / `steps` of `rl.sampler` and
`eval.sampler` may be `auto`. The prepare stage, which tokenizes every row anyway, derives them
(`derive`) and records them in `summary.json` under `lengths`; every later stage reads them back
(`resolve`), so all stages agree on one canvas. An explicit value always wins.

- a canvas (`pad_to`, `gen_length`) holds the longest tokenized response plus one EOS (the token
  that teaches the model to stop), rounded up to a multiple of an explicit `block_length`;
- `block_length: auto` is the whole canvas (one block), `steps: auto` one token per step;
- a model trained from scratch with `model.init.max_sequence_length: auto` (or the family's
  `max_position_embeddings: auto`) gets the longest prompt plus the longest canvas, rounded up to a
  multiple of 8.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from dare_core.recipes import MODEL_LENGTH_KEYS as LENGTH_KEYS  # what families call a model's length
from dare_core.recipes import SAMPLER_KEYS

AUTO = "auto"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def sampler_lengths(sampler: Any, canvas: int) -> dict[str, int]:
    """The values of a sampler's `auto` lengths for a response canvas of `canvas` tokens."""
    block = None if sampler.block_length == AUTO else sampler.block_length
    gen = sampler.gen_length if sampler.gen_length != AUTO else (_round_up(canvas, block) if block else canvas)
    values = {"gen_length": gen, "block_length": block or gen, "steps": gen if sampler.steps == AUTO else sampler.steps}
    return {key: values[key] for key in SAMPLER_KEYS if getattr(sampler, key) == AUTO}


def canvases(cfg: Any, response_tokens: int, pair_tokens: int) -> dict[str, int]:
    """Every `auto` length of the config that follows from the data, by dotted key; the explicit ones
    as they are under the same keys, so callers read one mapping."""
    out: dict[str, int] = {}
    out["sft.pad_to"] = response_tokens + 1 if cfg.sft.pad_to == AUTO else cfg.sft.pad_to
    pairs = pair_tokens or response_tokens
    out["preference.pad_to"] = pairs + 1 if cfg.preference.pad_to == AUTO else cfg.preference.pad_to
    for section in ("rl", "eval"):
        sampler = getattr(cfg, section).sampler
        derived = sampler_lengths(sampler, response_tokens + 1)
        for key in SAMPLER_KEYS:
            out[f"{section}.sampler.{key}"] = derived.get(key, getattr(sampler, key))
    return out


def model_length_key(cfg: Any) -> Optional[str]:
    """The config.json key of a from-scratch model's length when `model.init` leaves it to the data
    (`max_sequence_length: auto`, or `max_position_embeddings: auto`: whatever the family calls it)."""
    if cfg.model.path is not None:
        return None
    return next((k for k in LENGTH_KEYS if cfg.model.init.get(k) == AUTO), None)


def model_length(longest_prompt: int, lengths: dict[str, int]) -> int:
    canvas = max(lengths["sft.pad_to"], lengths["preference.pad_to"], lengths["rl.sampler.gen_length"],
                 lengths["eval.sampler.gen_length"])
    return _round_up(longest_prompt + canvas, 8)


def has_auto(cfg: Any) -> bool:
    samplers = (cfg.rl.sampler, cfg.eval.sampler)
    return (AUTO in (cfg.sft.pad_to, cfg.preference.pad_to) or any(getattr(s, k) == AUTO for s in samplers for k in SAMPLER_KEYS)
            or model_length_key(cfg) is not None)


def resolve(cfg: Any, summary: Optional[dict] = None) -> Any:
    """`cfg` with every `auto` length replaced by the value the prepare stage derived (read from
    `<data.prepared_dir>/summary.json` unless `summary` is given). Unchanged when nothing is auto."""
    if not has_auto(cfg):
        return cfg
    from dare_core.config import ConfigError
    from dare_core.storage import read_json

    if summary is None:
        path = Path(cfg.data.prepared_dir) / "summary.json"
        summary = read_json(path) if path.is_file() else {}
    lengths = summary.get("lengths") if isinstance(summary, dict) else None
    if not lengths:
        raise ConfigError(f"lengths set to auto need the prepare stage's {Path(cfg.data.prepared_dir) / 'summary.json'} "
                          f"(it derives them from the data): run `dare stage prepare` first")
    sft = dataclasses.replace(cfg.sft, pad_to=lengths["sft.pad_to"]) if cfg.sft.pad_to == AUTO else cfg.sft
    pref = dataclasses.replace(cfg.preference, pad_to=lengths["preference.pad_to"]) if cfg.preference.pad_to == AUTO else cfg.preference
    sections = {}
    for name in ("rl", "eval"):
        section = getattr(cfg, name)
        auto = {k: lengths[f"{name}.sampler.{k}"] for k in SAMPLER_KEYS if getattr(section.sampler, k) == AUTO}
        sections[name] = dataclasses.replace(section, sampler=dataclasses.replace(section.sampler, **auto)) if auto else section
    model = cfg.model
    key = model_length_key(cfg)
    if key is not None and "model.length" in lengths:
        model = dataclasses.replace(cfg.model, init={**cfg.model.init, key: lengths["model.length"]})
    return dataclasses.replace(cfg, sft=sft, preference=pref, rl=sections["rl"], eval=sections["eval"], model=model)
