"""Raw or synthetic data -> `<prepared_dir>/{sft,rl,eval,val,preference}.parquet` + `summary.json`.

Eval problems never appear in sft, rl or preference; val problems (in-loop RL validation) never in
sft, rl, eval or derived preference pairs (sft and rl may share problems when the pool is small;
preference pairs are built on training problems).
Every row is validated, including that prompt + generation canvas fit the model and that the reward
that will grade it can parse its ground truth, before anything is written; the prepared folder and
the tokenizer (from scratch) are then written to temporary folders and swapped in together, so an
error, a full or a read-only disk leaves the old outputs as they were.
"""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from dare_core.config import DareConfig
from dare_core.data.schema import DataError, check_ground_truths, read_rows, validate_rows, write_rows
from dare_core.data.tasks import get_task
from dare_core.models.tokenizer import Tokenizer, char_tokenizer, load_tokenizer
from dare_core.rewards.instructions import add_instruction, check_rows
from dare_core.storage import atomic_dirs, atomic_write_json, check_writable, read_json

SPLITS = ("sft", "rl", "eval", "val", "preference")
# Sequence length of a from-scratch model whose init config does not say.
DEFAULT_MAX_LENGTH = 128
# Synthetic pools are drawn with doubling sizes until enough distinct problems appear; this bounds it.
_MAX_DOUBLINGS = 12
# A text of n characters has at least n / (SLACK * longest token) tokens: the longest vocabulary entry
# covers that many characters at most, and SLACK allows for a normalizer that shortens the text
# (combining accents). It rejects an oversized text without tokenizing it (a 20 MB prompt).
_SLACK = 4
# how the splits a reward grades are graded: RL and its validation with rl.reward, eval by task
_GRADED_BY = {"rl": "rl", "val": "rl", "eval": "auto"}


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
    model_config = read_json(path)
    for key in ("max_sequence_length", "max_position_embeddings"):
        if isinstance(model_config, dict) and isinstance(model_config.get(key), int):
            return model_config[key]
    raise ValueError(f"{path}: has neither max_sequence_length nor max_position_embeddings")


def _need_min(cfg: DareConfig) -> int:
    """The fewest distinct problems that keep eval and val disjoint from each other and from training."""
    data = cfg.data
    return data.num_eval + data.num_val + max(data.num_sft, data.num_rl)


_NEED_MIN = "num_eval + num_val + max(num_sft, num_rl)"


def _synthetic_pool(cfg: DareConfig, need: int, need_min: int) -> list[dict]:
    data = cfg.data
    task = get_task(data.task)
    possible = task.num_distinct(**data.task_args) if hasattr(task, "num_distinct") else None
    if possible is not None and possible < need_min:
        raise DataError(f"task {data.task} with task_args {data.task_args} can produce only {possible} "
                        f"distinct problems; eval and val must be disjoint from sft, rl and each "
                        f"other, which needs {_NEED_MIN} = {need_min}")
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
                    f"in {draws // 2} draws; need {_NEED_MIN} = {need_min}")


def _check_unique(rows: list[dict], path: str) -> None:
    """Two rows with one uid, or with one prompt and different ground truths, are a broken file (a
    silent pick of one would train on an arbitrary answer); an exact repeat is merely dropped."""
    uids: dict[str, tuple[int, tuple]] = {}
    truths: dict[str, tuple[int, str]] = {}
    for index, row in enumerate(rows):
        uid, content = row.get("uid"), tuple(row.get(c) for c in ("prompt", "response", "ground_truth", "task"))
        if uid is not None:
            first_uid = uids.setdefault(uid, (index, content))
            if first_uid[1] != content:
                raise DataError(f"{path}: rows {first_uid[0]} and {index} have the same uid {uid!r}")
        first = truths.setdefault(row["prompt"], (index, row["ground_truth"]))
        if first[1] != row["ground_truth"]:
            raise DataError(f"{path}: rows {first[0]} and {index} have the same prompt but different ground truths "
                            f"({_clip(first[1])!r} and {_clip(row['ground_truth'])!r})")


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _max_token_chars(tokenizer: Tokenizer) -> int:
    return max((len(token) for token in tokenizer.backend.get_vocab()), default=1)


def _check_size(rows: list[dict], columns: tuple[str, ...], tokenizer: Tokenizer, limit: int, path: str) -> None:
    """Reject a text that cannot fit the model whatever its tokens, before any tokenizing."""
    per_token = _SLACK * _max_token_chars(tokenizer)
    for index, row in enumerate(rows):
        for column in columns:
            text = row.get(column)
            if isinstance(text, str) and len(text) > per_token * limit:
                raise DataError(f"{path}: row {index}: column '{column}' is {len(text)} characters, at least "
                                f"{len(text) // per_token} tokens > max sequence length {limit}")


def _source_pool(cfg: DareConfig, tokenizer: Tokenizer, limit: int) -> list[dict]:
    path = cfg.data.source
    rows = read_rows(path, "source")
    _check_size(rows, ("prompt", "response"), tokenizer, limit, str(path))
    # Raw math/gsm8k prompts rarely ask for the format the reward parses (\boxed{}): append it, unless
    # task_args.append_instruction is false (prompts already templated; then they are only checked).
    append = cfg.data.task_args.get("append_instruction", True)
    for index, row in enumerate(rows):
        if not row.get("task"):
            row["task"] = cfg.data.task
        if append and isinstance(row.get("prompt"), str):
            row["prompt"] = add_instruction(row["task"], row["prompt"])
        row["_where"] = f"{path}: row {index}"
    _check_unique(rows, str(path))
    # every row may land in rl, val or eval: its ground truth must suit the reward that grades it
    check_ground_truths(rows, cfg.rl.reward, str(path))
    rows = _dedupe(rows)
    # A file may be ordered (by source, by difficulty); eval must be a fair sample of it.
    random.Random(cfg.data.seed).shuffle(rows)
    return rows


def _split(pool: list[dict], cfg: DareConfig, origin: str) -> dict[str, list[dict]]:
    n_sft, n_rl, n_eval, n_val = cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval, cfg.data.num_val
    need_min = _need_min(cfg)
    if len(pool) < need_min:
        raise DataError(f"{origin}: {len(pool)} distinct prompts, need {_NEED_MIN} = {need_min} "
                        f"(eval and val are disjoint from sft, rl and each other)")
    # Eval at the head, val at the tail: a synthetic pool only grows at its end (a task's draws do not
    # depend on how many are asked for), so adding val leaves sft, rl and eval as they were.
    train = _train(pool, cfg)
    # Disjoint sft/rl when the pool allows; otherwise rl takes the tail and overlaps sft.
    splits = {"sft": train[:n_sft], "rl": train[len(train) - n_rl:], "eval": pool[:n_eval],
              "val": pool[len(pool) - n_val:]}
    for split, rows in splits.items():
        for index, row in enumerate(rows):
            row.setdefault("_where", f"{origin}: {split} row {index}")
    return splits


def _train(pool: list[dict], cfg: DareConfig) -> list[dict]:
    """The training problems of the pool: neither eval (the head) nor val (the tail)."""
    return pool[cfg.data.num_eval:len(pool) - cfg.data.num_val]


def _wrong_digit(text: str, rng: random.Random) -> str | None:
    """`text` with one of its digits moved up or down by one (mod 10), never a leading zero of a
    zero-padded number (an implausible mistake); None without digits."""
    positions = []
    for number in re.finditer(r"\d+", text):
        digits = number.group()
        lead = len(digits) - len(digits.lstrip("0"))
        positions += range(number.start() + min(lead, len(digits) - 1), number.end())
    if not positions:
        return None
    i = rng.choice(positions)
    return text[:i] + str((int(text[i]) + rng.choice((1, 9))) % 10) + text[i + 1:]


def _derived_pairs(train: list[dict], cfg: DareConfig, origin: str) -> list[dict]:
    """Preference pairs from training problems, in pool order, at most data.num_preference:

    - a demonstration that is a bare number other than the ground truth (arithmetic: the task's
      own forgotten-carry error): chosen = the ground truth, rejected = that demonstration;
    - else, when the ground truth appears in the response (the answer itself, or a worked solution
      ending in it): chosen = the response, rejected = the response with one digit of (the last
      occurrence of) the answer off by one;
    - other rows (e.g. a ground truth that is a checker's spec, not an answer) give no pair."""
    from dare_core.diffusion.seeding import derive_seed

    number = re.compile(r"-?\d+")
    rng = random.Random(derive_seed(cfg.data.seed, "preference-pairs"))
    pairs = []
    for row in train:
        if len(pairs) >= cfg.data.num_preference:
            break
        response, truth = row["response"], row["ground_truth"]
        if response != truth and number.fullmatch(response) and number.fullmatch(truth):
            chosen, rejected = truth, response
        elif truth in response:
            wrong = _wrong_digit(truth, rng)
            if wrong is None:
                continue
            k = response.rfind(truth)
            chosen, rejected = response, response[:k] + wrong + response[k + len(truth):]
        else:
            continue
        pairs.append({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected, "task": row["task"],
                      "_where": f"{origin}: preference row {len(pairs)}"})
    return pairs


def _preference_rows(cfg: DareConfig, train: list[dict], eval_rows: list[dict], origin: str, tokenizer: Tokenizer,
                     limit: int) -> tuple[list[dict], dict]:
    """The preference split: data.preference_source as given, or pairs derived from `train`.
    Pairs on an eval prompt are dropped (counted in the summary): eval stays unseen."""
    path = cfg.data.preference_source
    if path:
        rows = read_rows(path, "preference_source")
        _check_size(rows, ("prompt", "chosen", "rejected"), tokenizer, limit, str(path))
        seen: dict[str, int] = {}
        for index, row in enumerate(rows):
            if row["chosen"] == row["rejected"]:
                raise DataError(f"{path}: row {index}: columns 'chosen' and 'rejected' are identical")
            if row.get("uid") is not None and seen.setdefault(row["uid"], index) != index:
                raise DataError(f"{path}: rows {seen[row['uid']]} and {index} have the same uid {row['uid']!r}")
            row.setdefault("task", cfg.data.task)
            row["_where"] = f"{path}: row {index}"
            if cfg.data.task_args.get("append_instruction", True):  # the same prompt format as sft/rl
                row["prompt"] = add_instruction(row["task"], row["prompt"])
        origin = str(path)
    else:
        rows = _derived_pairs(train, cfg, origin)
    held_out = {r["prompt"] for r in eval_rows}
    kept = [r for r in rows if r["prompt"] not in held_out]
    return kept, {"origin": origin if path else f"derived from {origin}", "dropped_eval_prompts": len(rows) - len(kept)}


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
        # The canvas must hold the response and at least one EOS (how the model learns to stop);
        # a longer response would be silently truncated.
        for column in {"sft": ("response",), "preference": ("chosen", "rejected")}.get(split, ()):
            r = len(_encode(tokenizer, row[column], row["_where"], column))
            if r + 1 > canvas:
                name = "response is" if column == "response" else f"column '{column}' is"
                raise DataError(f"{row['_where']}: {name} {r} tokens + 1 EOS > {split}.pad_to {canvas}")
        longest = max(longest, n)
    return longest


def prepare(cfg: DareConfig) -> dict[str, Any]:
    """Build (or load) the tokenizer, make and validate the splits, then write them. Returns the summary."""
    from_scratch = cfg.model.path is None
    outputs = [cfg.data.prepared_dir] + ([cfg.data.tokenizer_dir] if from_scratch else [])
    for output in outputs:
        check_writable(output)
    tokenizer = char_tokenizer() if from_scratch else load_tokenizer(cfg.model.path)
    limit = _max_length(cfg)
    counts = (cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval, cfg.data.num_val)
    if min(counts) < 0:
        raise DataError(f"data.num_sft, num_rl, num_eval and num_val must be >= 0, got {counts}")
    if cfg.data.source:
        origin, pool = str(cfg.data.source), _source_pool(cfg, tokenizer, limit)
    else:
        origin, pool = f"task {cfg.data.task}", _synthetic_pool(cfg, sum(counts), _need_min(cfg))
    # val is decoded by in-loop RL validation, with rl.sampler's canvas
    canvas = {"sft": cfg.sft.pad_to, "rl": cfg.rl.sampler.gen_length, "eval": cfg.eval.sampler.gen_length,
              "val": cfg.rl.sampler.gen_length, "preference": cfg.preference.pad_to}
    splits = _split(pool, cfg, origin)
    splits["preference"], preference_info = _preference_rows(cfg, _train(pool, cfg), splits["eval"], origin, tokenizer, limit)
    prepared, longest = {}, 0
    for split, rows in splits.items():
        rows = _finish(split, rows, tokenizer)
        validate_rows(rows, split, f"{origin} ({split})")
        if split in _GRADED_BY:  # the splits a reward grades
            try:
                check_rows(rows, split)
            except ValueError as exc:
                raise DataError(str(exc)) from None
            check_ground_truths(rows, cfg.rl.reward if _GRADED_BY[split] == "rl" else "auto", f"{origin} ({split})")
        longest = max(longest, _check_lengths(split, rows, tokenizer, canvas[split], limit))
        prepared[split] = rows

    tasks = sorted({row["task"] for rows in prepared.values() for row in rows})
    summary = {
        "task": tasks[0] if len(tasks) == 1 else None,
        "tasks": tasks,
        "source": cfg.data.source,
        "seed": cfg.data.seed,
        "counts": {split: len(rows) for split, rows in prepared.items()},
        "preference": preference_info,
        "max_prompt_tokens": longest,
        "max_length": limit,
        "vocab_size": tokenizer.vocab_size,
    }
    # Everything is valid: only now touch the disk, all outputs at once
    with atomic_dirs(*outputs) as tmps:
        for split in SPLITS:
            write_rows(tmps[0] / f"{split}.parquet", prepared[split], split)
        atomic_write_json(tmps[0] / "summary.json", summary)
        if from_scratch:
            tokenizer.save(tmps[1])
    return summary
