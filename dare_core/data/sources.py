"""Reading the user's files for the prepare stage: the training source (`data.source`) and the test
and validation files (`data.eval_source`, `data.val_source`), each row checked where it stands.

Every row leaves here with
- `task`: the built-in task whose instruction and reward it follows (its own `task` column, else
  `data.task`),
- `_label`: the name its scores are reported under (its own `task` column, else `data.task_name`,
  else the training file's stem),
- `reward` / `reward_args`: what grades it (`rl.reward` and `rl.reward_args`, else its task's
  reward), checked against its ground truth here, so a bad row stops prepare naming file, row and
  column before anything is written,
- `_where`: its place in the file ("<file>: line N" of a JSON-lines file, "<file>: row N" of a
  parquet file, from 1), for every later error.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

from dare_core.data.schema import DataError, Place, check_ground_truths, read_rows, two_places
from dare_core.data.synthetic import TASKS
from dare_core.errors import clip
from dare_core.models.tokenizer import Tokenizer
from dare_core.rewards.instructions import add_instruction
from dare_core.rewards.scoring import reward_name_for

# A text of n characters has at least n / (SLACK * longest token) tokens: the longest vocabulary entry
# covers that many characters at most, and SLACK allows for a normalizer that shortens the text
# (combining accents). It rejects an oversized text without tokenizing it (a 20 MB prompt).
_SLACK = 4


def task_label(cfg: Any) -> str:
    """What scores of rows without a `task` column are called."""
    if cfg.data.task_name:
        return cfg.data.task_name
    return Path(cfg.data.source).stem if cfg.data.source else cfg.data.task


def attach_reward(row: dict, cfg: Any, task: str) -> None:
    """Set the row's `reward` (and `reward_args`) columns to what grades `task`; an error names the row."""
    try:
        row["reward"], reward_args = reward_of(cfg, task)
    except DataError as exc:
        raise DataError(f"{row['_where']}: {exc}") from None
    if reward_args:
        row["reward_args"] = reward_args


def reward_of(cfg: Any, task: str) -> tuple[str, Optional[str]]:
    """(reward, reward_args as JSON or None) that grades rows of `task`."""
    args = getattr(cfg.rl, "reward_args", None) or None
    if cfg.rl.reward != "auto":
        return cfg.rl.reward, json.dumps(args, sort_keys=True) if args else None
    if task in TASKS:
        return TASKS[task].reward, None
    try:
        return reward_name_for({"task": task}), None
    except ValueError:
        raise DataError(f"no reward grades task {task!r}: set rl.reward to a built-in reward (exact_match, "
                        f"numeric, regex_match, choice, ...) or to your own as module:function") from None


def label_rows(rows: list[dict], cfg: Any, graded: bool) -> None:
    """Task, label and reward of each row (in place)."""
    label, append = task_label(cfg), cfg.data.task_args.get("append_instruction", True)
    for row in rows:
        own = row.get("task")
        row["task"], row["_label"] = own or cfg.data.task, own or label
        # Raw math/gsm8k prompts rarely ask for the format the reward parses (\boxed{}): append it,
        # unless task_args.append_instruction is false (prompts already templated; then only checked)
        if append and isinstance(row.get("prompt"), str):
            row["prompt"] = add_instruction(row["task"], row["prompt"])
        if graded:
            attach_reward(row, cfg, row["task"])


def max_token_chars(tokenizer: Tokenizer) -> int:
    return max((len(token) for token in tokenizer.backend.get_vocab()), default=1)


def check_size(rows: list[dict], columns: tuple[str, ...], tokenizer: Tokenizer, limit: int) -> None:
    """Reject a text that cannot fit the model whatever its tokens, before any tokenizing."""
    per_token = _SLACK * max_token_chars(tokenizer)
    for row in rows:
        for column in columns:
            text = row.get(column)
            if isinstance(text, str) and len(text) > per_token * limit:
                raise DataError(f"{row['_where']}: column '{column}' is {len(text)} characters, at least "
                                f"{len(text) // per_token} tokens > max sequence length {limit}")


def check_unique(rows: list[dict]) -> None:
    """Two rows with one uid, or with one prompt and different ground truths, are a broken file (a
    silent pick of one would train on an arbitrary answer); an exact repeat is merely dropped."""
    uids: dict[str, tuple[Place, tuple]] = {}
    truths: dict[str, tuple[Place, str]] = {}
    for row in rows:
        uid, content = row.get("uid"), tuple(row.get(c) for c in ("prompt", "response", "ground_truth", "task"))
        if uid is not None:
            first_uid = uids.setdefault(uid, (row["_where"], content))
            if first_uid[1] != content:
                raise DataError(f"{two_places(first_uid[0], row['_where'])} have the same uid {uid!r}")
        first = truths.setdefault(row["prompt"], (row["_where"], row["ground_truth"]))
        if first[1] != row["ground_truth"]:
            raise DataError(f"{two_places(first[0], row['_where'])} have the same prompt but different ground "
                            f"truths ({clip(first[1], 60)!r} and {clip(row['ground_truth'], 60)!r})")


def check_distinct_uids(rows: list[dict]) -> None:
    """Two rows of a file used as it is (nothing is dropped) may not share a uid: results are keyed by it."""
    seen: dict[str, Place] = {}
    for row in rows:
        uid = row.get("uid")
        if uid in seen:
            raise DataError(f"{two_places(seen[uid], row['_where'])} have the same uid {uid!r}")
        if uid is not None:
            seen[uid] = row["_where"]


def dedupe(rows: list[dict]) -> list[dict]:
    seen: set[str] = set()
    unique = []
    for row in rows:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            unique.append(row)
    return unique


def source_pool(cfg: Any, tokenizer: Tokenizer, limit: int) -> list[dict]:
    """The training file's distinct rows, shuffled with data.seed (a file may be ordered by source or
    difficulty; a carved eval split must be a fair sample of it)."""
    path = cfg.data.source
    rows = read_rows(path, "source", where=True)
    check_size(rows, ("prompt", "response"), tokenizer, limit)
    # every row may land in rl, val or eval: its ground truth must suit the reward that grades it
    label_rows(rows, cfg, graded=True)
    check_unique(rows)
    check_ground_truths(rows, "auto", str(path))
    rows = dedupe(rows)
    random.Random(cfg.data.seed).shuffle(rows)
    return rows


def side_rows(cfg: Any, setting: str, tokenizer: Tokenizer, limit: int) -> list[dict]:
    """The test or validation file `setting` names (data.eval_source, data.val_source), used as it
    is: every row, in its order."""
    path = getattr(cfg.data, setting.split(".")[1])
    rows = read_rows(path, "eval_source", where=True)
    if not rows:
        # as an empty training file is: a split with nothing in it would score or validate nothing
        raise DataError(f"{path}: no rows ({setting}); give it at least one problem, or leave {setting} empty to "
                        f"carve the split out of the training data")
    check_size(rows, ("prompt",), tokenizer, limit)
    label_rows(rows, cfg, graded=True)
    check_distinct_uids(rows)
    check_ground_truths(rows, "auto", str(path))
    return rows
