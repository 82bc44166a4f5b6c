"""Raw or synthetic data -> `<prepared_dir>/{sft,rl,eval,val,preference}.parquet` + `summary.json`.

Eval problems never appear in sft, rl or preference; val problems (in-loop RL validation) never in
sft, rl, eval or derived preference pairs (preference pairs are built on training problems). sft and
rl are disjoint when the pool is large enough, else they share problems and the summary says how
many. `data.eval_source` / `data.val_source` replace the carved eval / val splits with the user's own
files, used as they are (prompts they share with the training data are counted in the summary).
Lengths set to `auto` are derived here from the tokenized data (lengths.py) and recorded in the
summary, which every later stage reads them from.
Every row is validated, including that prompt + generation canvas fit the model and that the reward
that will grade it can parse its ground truth, before anything is written; the prepared folder and
the tokenizer (from scratch) are then written to temporary folders and swapped in together, so an
error, a full or a read-only disk leaves the old outputs as they were.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Optional

from dare_core.config import ConfigError, DareConfig
from dare_core.data import lengths as derived
from dare_core.data.made_from import made_from
from dare_core.data.pairs import pairs_required, why_no_pairs
from dare_core.data.schema import DataError, check_ground_truths, read_rows, validate_rows, write_rows
from dare_core.data.sources import (attach_reward, check_distinct_uids, check_size, dedupe, side_rows, source_pool,
                                   task_label)
from dare_core.data.synthetic import get_task
from dare_core.data.synthetic.registry import check_task_args
from dare_core.inputs import model_folder
from dare_core.models.tokenizer import TOKENIZER_FILES, Tokenizer, char_tokenizer, load_tokenizer
from dare_core.ownership import check_replaceable
from dare_core.rewards.instructions import add_instruction, check_rows
from dare_core.storage import atomic_dirs, atomic_write_json, check_writable, read_json

SPLITS = ("sft", "rl", "eval", "val", "preference")
# what prepare writes into its folders (an unmarked folder holding only these is an earlier one's: ownership.py)
WRITES = (*(f"{split}.parquet" for split in SPLITS), "summary.json", *TOKENIZER_FILES)
# Sequence length of a from-scratch model whose init config does not say.
DEFAULT_MAX_LENGTH = 128
# Synthetic pools are drawn with doubling sizes until enough distinct problems appear; this bounds it.
_MAX_DOUBLINGS = 12
# Before the data fixes a from-scratch model's length (lengths.py), no text may exceed this many tokens.
_UNSIZED_LIMIT = 1 << 16
# the splits a reward grades (their rows carry the reward: one grader for RL, validation and eval)
_GRADED = ("rl", "val", "eval")


def _max_length(cfg: DareConfig, length_key: Optional[str] = None) -> int:
    """The model's length (a from-scratch model's checked `model.init`, or the folder's config.json).
    `length_key`: the init key left to the data (`auto`); the shapes are still checked here, with a
    stand-in length, so that a bad head count stops prepare rather than the SFT stage after it."""
    if cfg.model.path is None:
        # whatever the family calls it (max_sequence_length, max_position_embeddings), its config says
        from dare_core.models.family import get_family

        family = get_family(cfg.model.family)
        if family.tiny_config is None:
            return DEFAULT_MAX_LENGTH
        family.check_init(cfg.model.init)  # a typo is named, not one more key nothing reads
        init = {**cfg.model.init, length_key: _UNSIZED_LIMIT} if length_key else cfg.model.init
        try:
            length = family.config_from_hf(family.tiny_config(8, 7, 6, **init)).max_sequence_length
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:  # checked here too: prepare writes first
            raise ConfigError(f"model.init: {exc}") from None
        return _UNSIZED_LIMIT if length_key else length
    path = model_folder(cfg) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path}")
    model_config = read_json(path)
    for key in ("max_sequence_length", "max_position_embeddings"):
        if isinstance(model_config, dict) and isinstance(model_config.get(key), int):
            return model_config[key]
    raise ValueError(f"{path}: has neither max_sequence_length nor max_position_embeddings")


def _carved(cfg: DareConfig) -> tuple[int, int]:
    """How many eval and val problems come out of the training pool (none for a split that has its
    own file)."""
    return (0 if cfg.data.eval_source else cfg.data.num_eval), (0 if cfg.data.val_source else cfg.data.num_val)


def _need_min(cfg: DareConfig) -> int:
    """The fewest distinct problems that keep eval and val disjoint from each other and from training."""
    n_eval, n_val = _carved(cfg)
    return n_eval + n_val + max(cfg.data.num_sft, cfg.data.num_rl)


_NEED_MIN = "num_eval + num_val + max(num_sft, num_rl)"


def _synthetic_pool(cfg: DareConfig, need: int, need_min: int) -> list[dict]:
    data = cfg.data
    task = get_task(data.task)
    check_task_args(task, data.task_args)
    try:
        possible = task.num_distinct(**data.task_args) if hasattr(task, "num_distinct") else None
    except (TypeError, ArithmeticError) as exc:  # values each of the right type that do not go together
        raise DataError(f"data.task_args {data.task_args}: task {data.task} cannot use them ({exc})") from None
    if possible is not None and possible < need_min:
        raise DataError(f"task {data.task} with task_args {data.task_args} can produce only {possible} "
                        f"distinct problems; eval and val must be disjoint from sft, rl and each "
                        f"other, which needs {_NEED_MIN} = {need_min}")
    target = need if possible is None else min(need, possible)
    draws = max(target, 1)
    for _ in range(_MAX_DOUBLINGS):
        unique = dedupe(task.generate(draws, data.seed, **data.task_args))
        if len(unique) >= target:
            return unique[:target]
        draws *= 2
    if len(unique) >= need_min:
        return unique
    raise DataError(f"task {data.task} with task_args {data.task_args}: only {len(unique)} distinct problems "
                    f"in {draws // 2} draws; need {_NEED_MIN} = {need_min}")


def _split(pool: list[dict], cfg: DareConfig, origin: str) -> dict[str, list[dict]]:
    n_sft, n_rl = cfg.data.num_sft, cfg.data.num_rl
    n_eval, n_val = _carved(cfg)
    need_min = _need_min(cfg)
    if len(pool) < need_min:
        raise DataError(f"{origin}: {len(pool)} distinct prompts, need {_NEED_MIN} = {need_min} "
                        f"(eval and val are disjoint from sft, rl and each other)")
    # Eval at the head, val at the tail: a synthetic pool only grows at its end (a task's draws do not
    # depend on how many are asked for), so adding val leaves sft, rl and eval as they were.
    train = _train(pool, cfg)
    # Disjoint sft/rl when the pool allows; otherwise rl takes the tail and overlaps sft (reported).
    splits = {"sft": train[:n_sft], "rl": train[len(train) - n_rl:], "eval": pool[:n_eval],
              "val": pool[len(pool) - n_val:] if n_val else []}
    for split, rows in splits.items():
        for index, row in enumerate(rows):
            row.setdefault("_where", f"{origin}: {split} row {index + 1}")  # a synthetic problem
    return splits


def _train(pool: list[dict], cfg: DareConfig) -> list[dict]:
    """The training problems of the pool: neither eval (the head) nor val (the tail)."""
    n_eval, n_val = _carved(cfg)
    return pool[n_eval:len(pool) - n_val]


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
                      "_label": row.get("_label", row["task"]), "_where": _pair_where(len(pairs) + 1, row, origin)})
    return pairs


def _pair_where(number: int, row: dict, origin: str) -> str:
    """A derived pair is on no line of a file: it is named by its number and the problem it comes from."""
    return f"derived preference pair {number} (from {row.get('_where') or origin})"


def _preference_rows(cfg: DareConfig, train: list[dict], eval_rows: list[dict], origin: str, tokenizer: Tokenizer,
                     limit: int) -> tuple[list[dict], dict]:
    """The preference split: data.preference_source as given, or pairs derived from `train`.
    Pairs on an eval prompt are dropped (counted in the summary): eval stays unseen."""
    path = cfg.data.preference_source
    if path:
        rows = read_rows(path, "preference_source", where=True)
        check_size(rows, ("prompt", "chosen", "rejected"), tokenizer, limit)
        check_distinct_uids(rows)
        for row in rows:
            if row["chosen"] == row["rejected"]:
                raise DataError(f"{row['_where']}: columns 'chosen' and 'rejected' are identical")
            row["_label"] = row.get("task") or task_label(cfg)
            row.setdefault("task", cfg.data.task)
            if cfg.data.task_args.get("append_instruction", True):  # the same prompt format as sft/rl
                row["prompt"] = add_instruction(row["task"], row["prompt"])
        origin = str(path)
    else:
        rows = _derived_pairs(train, cfg, origin)
    held_out = {r["prompt"] for r in eval_rows}
    kept = [r for r in rows if r["prompt"] not in held_out]
    return kept, {"origin": origin if path else f"derived from {origin}", "dropped_eval_prompts": len(rows) - len(kept)}


def _finish(split: str, rows: list[dict], tokenizer: Tokenizer, cfg: DareConfig) -> list[dict]:
    """Rows as written: the prompt rendered with the chat template, a uid, the task's label as `task`
    (the task followed stays as `_kind` for the checks) and, on graded splits, the reward."""
    out = []
    for index, row in enumerate(rows):
        prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                    add_generation_prompt=True)
        uid = row.get("uid") or f"{split}-{index}"
        done = {**row, "uid": uid, "prompt_text": prompt_text, "_kind": row["task"], "task": row.get("_label", row["task"])}
        if split in _GRADED and "reward" not in row:
            attach_reward(done, cfg, row["task"])
        out.append(done)
    return out


def _encode(tokenizer: Tokenizer, text: str, where: str, column: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as exc:
        raise DataError(f"{where}: column '{column}': {exc}") from exc


def _longest(rows: list[dict], columns: tuple[str, ...], tokenizer: Tokenizer) -> int:
    return max((len(_encode(tokenizer, row[c], row["_where"], c)) for row in rows for c in columns if row.get(c)), default=0)


def _check_lengths(split: str, rows: list[dict], tokenizer: Tokenizer, canvas: int, limit: int, key: str) -> None:
    """Raise unless prompt + generation canvas fits the model and every response fits its canvas."""
    for row in rows:
        n = len(_encode(tokenizer, row["prompt_text"], row["_where"], "prompt_text"))
        if n + canvas > limit:
            raise DataError(f"{row['_where']}: prompt is {n} tokens (with chat template) + {canvas} "
                            f"{split} generation tokens ({key}) = {n + canvas} > max sequence length {limit}")
        # The canvas must hold the response and at least one EOS (how the model learns to stop): a
        # longer response is silently truncated in training, and a sampler canvas that cannot hold
        # the answers the model was taught caps accuracy without a word (rows of a test file carry
        # no response: `_check_sampler_canvases` holds them to the training responses)
        for column in {"preference": ("chosen", "rejected")}.get(split, ("response",)):
            if not row.get(column):
                continue
            r = len(_encode(tokenizer, row[column], row["_where"], column))
            if r + 1 > canvas:
                name = "response is" if column == "response" else f"column '{column}' is"
                raise DataError(f"{row['_where']}: {name} {r} tokens + 1 EOS > {key} {canvas}{_fix(key, r + 1)}")


def _fix(key: str, need: int) -> str:
    return f": set {key} to auto (derived from the data) or at least {need}"


def _check_sampler_canvases(sft_rows: list[dict], tokenizer: Tokenizer, lengths: dict[str, int]) -> None:
    """Each sampler canvas holds the longest answer SFT teaches, plus its EOS."""
    sized = [(len(_encode(tokenizer, row["response"], row["_where"], "response")), index) for index, row in enumerate(sft_rows)]
    if not sized:
        return
    r, index = max(sized)
    longest = sft_rows[index]
    for key in ("rl.sampler.gen_length", "eval.sampler.gen_length"):
        if r + 1 > lengths[key]:
            raise DataError(f"{longest['_where']}: response is {r} tokens + 1 EOS > {key} {lengths[key]}, so the "
                            f"sampler cannot write the answers SFT teaches{_fix(key, r + 1)}")


def _overlaps(splits: dict[str, list[dict]], train_rows: list[dict]) -> dict[str, int]:
    """Prompts shared between splits that should not share them (the manifest reports them); eval and
    val against every training problem of the pool, used or not."""
    prompts = {split: {r["prompt"] for r in rows} for split, rows in splits.items()}
    train = {r["prompt"] for r in train_rows}
    return {"sft_rl": len(prompts["sft"] & prompts["rl"]), "eval_train": len(prompts["eval"] & train),
            "val_train": len(prompts["val"] & train), "eval_val": len(prompts["eval"] & prompts["val"])}


def _check_pairs_wanted(cfg: DareConfig, pairs: list[dict], origin: str) -> None:
    if not pairs and cfg.preference.enabled is True:
        raise DataError(pairs_required(cfg, origin))


def _warnings(overlaps: dict[str, int], counts: dict[str, int], cfg: DareConfig) -> list[str]:
    out = []
    if not counts["preference"] and cfg.data.num_preference > 0 and cfg.preference.enabled is not False:
        out.append(f"data.num_preference is {cfg.data.num_preference}, but {why_no_pairs(cfg)}: the preference stage "
                   f"will be off")
    if overlaps["sft_rl"]:
        out.append(f"{overlaps['sft_rl']} of the {counts['rl']} RL prompts are also SFT prompts: the source has too few "
                   f"distinct prompts for data.num_sft + data.num_rl; lower them for disjoint splits")
    for key, what in (("eval_train", "test"), ("val_train", "validation")):
        if overlaps[key]:
            out.append(f"{overlaps[key]} {what} prompts also appear in the training data (data.source)")
    return out


@dataclass
class Prepared:
    """What prepare writes, every check passed and nothing written yet."""
    outputs: list[str]  # the prepared folder, and the tokenizer's for a from-scratch model
    splits: dict[str, list[dict]]
    summary: dict[str, Any]
    tokenizer: Tokenizer


def check_prepare(cfg: DareConfig) -> Prepared:
    """Build (or load) the tokenizer, make the splits and make every check of the stage, writing
    nothing: the stage, and the inputs stage's dry run of it (workers/settings_checks.py)."""
    from_scratch = cfg.model.path is None
    outputs = [cfg.data.prepared_dir] + ([cfg.data.tokenizer_dir] if from_scratch else [])
    for output in outputs:
        check_writable(output)
        check_replaceable(output, WRITES)  # a folder of the user's is never replaced
    tokenizer = char_tokenizer() if from_scratch else load_tokenizer(model_folder(cfg))
    length_key = derived.model_length_key(cfg)  # a from-scratch model sized by the data
    limit = _max_length(cfg, length_key)
    counts = (cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval, cfg.data.num_val)
    if min(counts) < 0:
        raise DataError(f"data.num_sft, num_rl, num_eval and num_val must be >= 0, got {counts}")
    if cfg.data.source:
        origin, pool = str(cfg.data.source), source_pool(cfg, tokenizer, limit)
    else:
        origin, pool = f"task {cfg.data.task}", _synthetic_pool(cfg, sum(counts), _need_min(cfg))
    splits = _split(pool, cfg, origin)
    for split, setting in (("eval", "data.eval_source"), ("val", "data.val_source")):
        if getattr(cfg.data, setting.split(".")[1]):
            splits[split] = side_rows(cfg, setting, tokenizer, limit)
    splits["preference"], preference_info = _preference_rows(cfg, _train(pool, cfg), splits["eval"], origin, tokenizer, limit)
    _check_pairs_wanted(cfg, splits["preference"], origin)
    prepared = {split: _finish(split, rows, tokenizer, cfg) for split, rows in splits.items()}
    for split, rows in prepared.items():
        validate_rows(rows, split, f"{origin} ({split})")
        if split in _GRADED:
            try:
                check_rows([{**r, "task": r["_kind"]} for r in rows], split)
            except ValueError as exc:
                raise DataError(str(exc)) from None
            check_ground_truths(rows, "auto", f"{origin} ({split})")  # each row names its reward

    lengths = derived.canvases(cfg, _longest(prepared["sft"], ("response",), tokenizer),
                               _longest(prepared["preference"], ("chosen", "rejected"), tokenizer))
    longest = max(_longest(rows, ("prompt_text",), tokenizer) for rows in prepared.values())
    if length_key:
        limit = lengths["model.length"] = derived.model_length(longest, lengths)
    # val is decoded by in-loop RL validation, with rl.sampler's canvas
    canvas_key = {"sft": "sft.pad_to", "rl": "rl.sampler.gen_length", "eval": "eval.sampler.gen_length",
                  "val": "rl.sampler.gen_length", "preference": "preference.pad_to"}
    for split, rows in prepared.items():
        _check_lengths(split, rows, tokenizer, lengths[canvas_key[split]], limit, canvas_key[split])
    _check_sampler_canvases(prepared["sft"], tokenizer, lengths)

    tasks = sorted({row["task"] for rows in prepared.values() for row in rows})
    counts_out = {split: len(rows) for split, rows in prepared.items()}
    overlaps = _overlaps(prepared, _train(pool, cfg))
    summary = {
        "task": tasks[0] if len(tasks) == 1 else None,
        "tasks": tasks,
        "source": cfg.data.source,
        "eval_source": cfg.data.eval_source,
        "val_source": cfg.data.val_source,
        "seed": cfg.data.seed,
        "counts": counts_out,
        "overlaps": overlaps,
        "warnings": _warnings(overlaps, counts_out, cfg),
        "rewards": sorted({row["reward"] for split in _GRADED for row in prepared[split]}),
        "preference": preference_info,
        "max_prompt_tokens": longest,
        "max_length": limit,
        "lengths": lengths,
        "vocab_size": tokenizer.vocab_size,
        "made_from": made_from(cfg),
    }
    return Prepared(outputs, prepared, summary, tokenizer)


def prepare(cfg: DareConfig) -> dict[str, Any]:
    """Check everything (check_prepare), then write the splits and the tokenizer, all outputs at
    once. Returns the summary."""
    done = check_prepare(cfg)
    with atomic_dirs(*done.outputs, writes=WRITES) as tmps:
        for split in SPLITS:
            write_rows(tmps[0] / f"{split}.parquet", done.splits[split], split)
        atomic_write_json(tmps[0] / "summary.json", done.summary)
        if len(done.outputs) > 1:  # a from-scratch model's tokenizer, made here
            done.tokenizer.save(tmps[1])
    return done.summary
