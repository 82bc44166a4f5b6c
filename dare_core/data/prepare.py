"""Raw or synthetic data -> `<prepared_dir>/{sft,rl,eval}.parquet` + `summary.json`.

Eval problems never appear in sft or rl (sft and rl may share problems when the pool is small).
Every row is validated, including that prompt + generation canvas fit the model, before anything is
written; the prepared folder is then replaced in one rename, so an error leaves no partial output.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from dare_core.config import DareConfig
from dare_core.data.schema import DataError, read_rows, validate_rows, write_rows
from dare_core.data.tasks import get_task
from dare_core.models.tokenizer import Tokenizer, char_tokenizer, load_tokenizer
from dare_core.storage import atomic_dir, atomic_write_json

SPLITS = ("sft", "rl", "eval")
# Sequence length of a from-scratch model whose init config does not say.
DEFAULT_MAX_LENGTH = 128
# Synthetic pools are drawn with doubling sizes until enough distinct problems appear; this bounds it.
_MAX_DOUBLINGS = 12


def _dedupe(rows: list[dict]) -> list[dict]:
    seen: set[str] = set()
    unique = []
    for row in rows:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            unique.append(row)
    return unique


def _max_length(cfg: DareConfig) -> int:
    if cfg.model.path is None:
        # whatever the family calls it (max_sequence_length, max_position_embeddings), its config says
        from dare_core.models.registry import get_family

        family = get_family(cfg.model.family)
        if family.tiny_config is None:
            return DEFAULT_MAX_LENGTH
        return family.config_from_hf(family.tiny_config(8, 7, 6, **cfg.model.init)).max_sequence_length
    path = Path(cfg.model.path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path}")
    model_config = json.loads(path.read_text())
    for key in ("max_sequence_length", "max_position_embeddings"):
        if key in model_config:
            return int(model_config[key])
    raise ValueError(f"{path}: has neither max_sequence_length nor max_position_embeddings")


def _synthetic_pool(cfg: DareConfig, need: int, need_min: int) -> list[dict]:
    data = cfg.data
    task = get_task(data.task)
    possible = task.num_distinct(**data.task_args) if hasattr(task, "num_distinct") else None
    if possible is not None and possible < need_min:
        raise DataError(f"task {data.task} with task_args {data.task_args} can produce only {possible} "
                        f"distinct problems; eval must be disjoint from sft and rl, which needs "
                        f"num_eval + max(num_sft, num_rl) = {need_min}")
    target = need if possible is None else min(need, possible)
    draws = max(target, 1)
    for _ in range(_MAX_DOUBLINGS):
        unique = _dedupe(task.generate(draws, data.seed, **data.task_args))
        if len(unique) >= target:
            return unique[:target]
        draws *= 2
    if len(unique) >= need_min:
        return unique
    raise DataError(f"task {data.task} with task_args {data.task_args}: only {len(unique)} distinct problems "
                    f"in {draws // 2} draws; need num_eval + max(num_sft, num_rl) = {need_min}")


def _source_pool(cfg: DareConfig) -> list[dict]:
    path = cfg.data.source
    rows = read_rows(path, "source")
    for index, row in enumerate(rows):
        if not row.get("task"):
            row["task"] = cfg.data.task
        row["_where"] = f"{path}: row {index}"
    rows = _dedupe(rows)
    # A file may be ordered (by source, by difficulty); eval must be a fair sample of it.
    random.Random(cfg.data.seed).shuffle(rows)
    return rows


def _split(pool: list[dict], cfg: DareConfig, origin: str) -> dict[str, list[dict]]:
    n_sft, n_rl, n_eval = cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval
    need_min = n_eval + max(n_sft, n_rl)
    if len(pool) < need_min:
        raise DataError(f"{origin}: {len(pool)} distinct prompts, need num_eval + max(num_sft, num_rl) = "
                        f"{need_min} (eval is disjoint from sft and rl)")
    train = pool[n_eval:]
    # Disjoint sft/rl when the pool allows; otherwise rl takes the tail and overlaps sft.
    splits = {"sft": train[:n_sft], "rl": train[len(train) - n_rl:], "eval": pool[:n_eval]}
    for split, rows in splits.items():
        for index, row in enumerate(rows):
            row.setdefault("_where", f"{origin}: {split} row {index}")
    return splits


def _finish(split: str, rows: list[dict], tokenizer: Tokenizer) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                    add_generation_prompt=True)
        uid = row.get("uid") or f"{split}-{index}"
        out.append({**row, "uid": uid, "prompt_text": prompt_text})
    return out


def _encode(tokenizer: Tokenizer, text: str, where: str, column: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as exc:
        raise DataError(f"{where}: column '{column}': {exc}") from exc


def _check_lengths(split: str, rows: list[dict], tokenizer: Tokenizer, canvas: int, limit: int) -> int:
    """Raise unless prompt + generation canvas fits the model; return the longest prompt in tokens."""
    longest = 0
    for row in rows:
        n = len(_encode(tokenizer, row["prompt_text"], row["_where"], "prompt_text"))
        if n + canvas > limit:
            raise DataError(f"{row['_where']}: prompt is {n} tokens (with chat template) + {canvas} "
                            f"{split} generation tokens = {n + canvas} > max sequence length {limit}")
        if split == "sft":
            # The canvas must hold the response and at least one EOS (how the model learns to stop);
            # a longer response would be silently truncated.
            r = len(_encode(tokenizer, row["response"], row["_where"], "response"))
            if r + 1 > canvas:
                raise DataError(f"{row['_where']}: response is {r} tokens + 1 EOS > sft.pad_to {canvas}")
        longest = max(longest, n)
    return longest


def prepare(cfg: DareConfig) -> dict[str, Any]:
    """Build (or load) the tokenizer, make and validate the splits, then write them. Returns the summary."""
    from_scratch = cfg.model.path is None
    tokenizer = char_tokenizer() if from_scratch else load_tokenizer(cfg.model.path)
    limit = _max_length(cfg)
    counts = (cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval)
    if cfg.data.source:
        origin, pool = str(cfg.data.source), _source_pool(cfg)
    else:
        need_min = cfg.data.num_eval + max(cfg.data.num_sft, cfg.data.num_rl)
        origin, pool = f"task {cfg.data.task}", _synthetic_pool(cfg, sum(counts), need_min)
    canvas = {"sft": cfg.sft.pad_to, "rl": cfg.rl.sampler.gen_length, "eval": cfg.eval.sampler.gen_length}
    prepared, longest = {}, 0
    for split, rows in _split(pool, cfg, origin).items():
        rows = _finish(split, rows, tokenizer)
        validate_rows(rows, split, f"{origin} ({split})")
        longest = max(longest, _check_lengths(split, rows, tokenizer, canvas[split], limit))
        prepared[split] = rows

    tasks = sorted({row["task"] for rows in prepared.values() for row in rows})
    summary = {
        "task": tasks[0] if len(tasks) == 1 else None,
        "tasks": tasks,
        "source": cfg.data.source,
        "seed": cfg.data.seed,
        "counts": {split: len(rows) for split, rows in prepared.items()},
        "max_prompt_tokens": longest,
        "max_length": limit,
        "vocab_size": tokenizer.vocab_size,
    }
    # Everything is valid: only now touch the disk.
    if from_scratch:
        tokenizer.save(cfg.data.tokenizer_dir)
    with atomic_dir(cfg.data.prepared_dir) as tmp:
        for split in SPLITS:
            write_rows(tmp / f"{split}.parquet", prepared[split], split)
        atomic_write_json(tmp / "summary.json", summary)
    return summary
