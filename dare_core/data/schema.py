"""Row schemas of raw and prepared data, with errors that name the file, the row and the column.

A row is named as the user finds it in the file: `<file>: line N` in a JSON-lines file (the line an
editor shows, blank lines counted), `<file>: row N` in a parquet file (from 1, as a spreadsheet
counts). `read_rows(..., where=True)` keeps that `Place` on each row as `_where`.

Kinds:
- `source`: raw input of data preparation (prompt, response, ground_truth; task and uid optional);
- `preference_source`: raw preference pairs (prompt, chosen, rejected; task and uid optional);
- `sft`, `rl`, `eval`, `val`, `preference`: the prepared parquet files, which all carry `prompt_text`, the prompt rendered
  with the chat template (so every stage feeds the model exactly the same prompt string).
Every column is a non-empty string. Columns outside a schema are ignored on read and not written.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq

from dare_core.errors import clip
from dare_core.object_cache import local_copy
from dare_core.remote import RemoteError, redact
from dare_core.storage import atomic_write_bytes, is_remote

PathLike = Union[str, Path]


class DataError(ValueError):
    """A data problem, naming the file (or task), the row and the column."""


@dataclass(frozen=True)
class Schema:
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        return self.required + self.optional


GRADED_OPTIONAL = ("reward", "reward_args")

SCHEMAS: dict[str, Schema] = {
    "source": Schema(("prompt", "response", "ground_truth"), ("task", "uid")),
    # ground_truth rides along in sft so SFT-time accuracy can be graded with the same reward.
    "sft": Schema(("prompt", "response", "task", "uid", "prompt_text"), ("ground_truth",)),
    # graded rows may carry their own reward: `reward` (a name or module:function) and `reward_args`
    # (a JSON object of its options), used where rl.reward is "auto" (dare_core/rewards/scoring.py)
    "rl": Schema(("prompt", "ground_truth", "task", "uid", "prompt_text"), GRADED_OPTIONAL),
    "eval": Schema(("prompt", "ground_truth", "task", "uid", "prompt_text"), GRADED_OPTIONAL),
    # held-out prompts of in-loop RL validation: graded like eval, never trained or evaluated on
    "val": Schema(("prompt", "ground_truth", "task", "uid", "prompt_text"), GRADED_OPTIONAL),
    # the user's own test / validation file (data.eval_source, data.val_source): used as it is
    "eval_source": Schema(("prompt", "ground_truth"), ("task", "uid", "response")),
    "preference_source": Schema(("prompt", "chosen", "rejected"), ("task", "uid")),
    # a pair: one prompt, the preferred response y_w and the dispreferred y_l (docs/algorithms.md#preference-optimisation)
    "preference": Schema(("prompt", "chosen", "rejected", "task", "uid", "prompt_text")),
}


@dataclass(frozen=True)
class Place:
    """Where a row stands in a file, numbered as the user sees it there."""
    file: str
    unit: str  # "line" (a JSON-lines file) or "row" (a table)
    number: int  # from 1

    def __str__(self) -> str:
        return f"{self.file}: {self.unit} {self.number}"


def table_row(file: PathLike, index: int) -> Place:
    """The row at `index` (from 0) of a table: the first data row is row 1, as a spreadsheet shows it."""
    return Place(str(file), "row", index + 1)


def two_places(first: Place, second: Place) -> str:
    """Two rows of one file in one message: '<file>: lines 3 and 9'."""
    return f"{first.file}: {first.unit}s {first.number} and {second.number}"


def where_of(row: dict, source: str, index: int) -> Union[str, Place]:
    """What a message calls `row`, the `index`-th (from 0) of `source`: where it was read (its
    `_where`), else its row of the table."""
    return row.get("_where") or table_row(source, index)


def get_schema(kind: str) -> Schema:
    if kind not in SCHEMAS:
        raise ValueError(f"unknown data kind '{kind}'; known kinds: {sorted(SCHEMAS)}")
    return SCHEMAS[kind]


def _check_value(row: dict, column: str, required: bool) -> str | None:
    value = row.get(column)
    if value is None:
        return "is missing" if required else None
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__} {value!r}"
    if not value:
        return "is an empty string"
    return None


def validate_rows(rows: list[dict], kind: str, source: str) -> None:
    """Raise DataError at the first row that lacks a required column or has a non-string/empty value."""
    schema = get_schema(kind)
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{table_row(source, index)} is not a mapping (got {type(row).__name__})")
        for column in schema.columns:
            problem = _check_value(row, column, column in schema.required)
            if problem:
                raise DataError(f"{where_of(row, source, index)}: column '{column}' {problem}")


def _check_row_reward(row: dict, where: Union[str, Place]) -> None:
    """The row's own `reward`/`reward_args` columns name a usable reward (read where rl.reward is auto)."""
    from dare_core.rewards.scoring import parse_reward_args
    from dare_core.rewards import RewardError, get_reward

    try:
        args = parse_reward_args(row.get("reward_args"))
    except ValueError as exc:  # names the column
        raise DataError(f"{where}: {clip(str(exc))}") from None
    if not row.get("reward"):
        return
    try:
        get_reward(row["reward"], args)
    except RewardError as exc:  # names the reward and what is wrong with it or its options
        raise DataError(f"{where}: {clip(str(exc))}") from None
    except ValueError as exc:  # an unknown name
        raise DataError(f"{where}: column 'reward': {clip(str(exc))}") from None


def check_ground_truths(rows: list[dict], reward: str, source: str, reward_args: Optional[dict] = None) -> None:
    """Raise DataError at the first row whose ground truth the reward that grades it (`reward` with
    `reward_args`, or with "auto" the row's own `reward` column, else its task's) could not parse:
    such a row would stop RL or evaluation mid-run. A configured reward that cannot be used (unknown
    name or option, a `module:function` that does not load) is a ConfigError."""
    from dare_core.config import ConfigError
    from dare_core.rewards.scoring import reward_for
    from dare_core.rewards import REWARDS, RewardError, check_ground_truth, get_reward

    if reward != "auto":
        try:
            get_reward(reward, reward_args)
        except ValueError as exc:
            raise ConfigError(f"rl.reward: {exc}") from None
    for index, row in enumerate(rows):
        where = where_of(row, source, index)
        if reward == "auto":
            _check_row_reward(row, where)
        try:
            name, args = reward_for(row, reward, reward_args)
        except ValueError:
            raise DataError(f"{where}: no reward grades task {row.get('task')!r} (rewards: {sorted(REWARDS)}; or set "
                            f"rl.reward, or the row's 'reward' column)") from None
        try:
            check_ground_truth(name, row["ground_truth"], args)
        except RewardError as exc:  # the reward or its options, not the ground truth, are at fault
            if reward != "auto":
                raise ConfigError(f"rl.reward: {clip(str(exc))} (at {where})") from None
            raise DataError(f"{where}: {clip(str(exc))}") from None
        except ValueError as exc:
            raise DataError(f"{where}: column 'ground_truth': {clip(str(exc))}") from None


# A row nested deeper than this is refused: no column DARE reads nests at all, and Python's JSON
# parser recurses, so a deep enough row would end in a RecursionError instead of a message
MAX_NESTING = 100


class _DuplicateKey(Exception):
    """A JSON object naming one key twice (json keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    row: dict = {}
    for key, value in pairs:
        if key in row:
            raise _DuplicateKey(key)
        row[key] = value
    return row


def _nesting(value: Any) -> int:
    """How many arrays and objects deep `value` goes (counted without recursion: it may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _parse_row(line: str, where: str) -> Any:
    """One JSON-lines row; a key given twice or nesting past MAX_NESTING is a DataError naming the row."""
    try:
        obj = json.loads(line, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise DataError(f"{where}: key {exc.args[0]!r} appears twice in one object; JSON would keep only the last, "
                        f"so remove one") from None
    except RecursionError:
        raise DataError(f"{where}: nested deeper than {MAX_NESTING} levels") from None
    # (only a line with that many brackets can nest so deep: most rows skip the walk)
    if line.count("[") + line.count("{") > MAX_NESTING and _nesting(obj) > MAX_NESTING:
        raise DataError(f"{where}: nested deeper than {MAX_NESTING} levels")
    return obj


def json_lines(path: Path, error: type = DataError, stream=None, name: Optional[str] = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSON-lines file; a line that is not a
    JSON object (or names a key twice, or nests too deep) raises `error` naming the file (`name`,
    else `path`) and the line. `stream`: an already opened text stream (e.g. gzip) instead of
    opening `path`."""
    where = name or path
    # bytes, decoded line by line: a non-UTF-8 byte is reported with its line
    with (stream if stream is not None else path.open("rb")) as f:
        for lineno, line in enumerate(f, start=1):
            if isinstance(line, bytes):
                try:
                    line = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise error(f"{where}: line {lineno}: not UTF-8 text (byte {exc.start} of the line)") from None
            if not line.strip():
                continue
            try:
                obj = _parse_row(line, f"{where}: line {lineno}")
            except json.JSONDecodeError as exc:
                raise error(f"{where}: line {lineno}: not valid JSON ({exc.msg})") from exc
            except DataError as exc:
                raise error(str(exc)) from None
            if not isinstance(obj, dict):
                raise error(f"{where}: line {lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _placed(row: dict, place: Place) -> dict:
    row["_where"] = place
    return row


def _read_jsonl(path: Path, name: str) -> list[dict]:
    # the line number comes from the reader, not the row's index: skipped blank lines shift it
    return [_placed(obj, Place(name, "line", lineno)) for lineno, obj in json_lines(path, name=name)]


def _read_parquet(path: Path, name: str) -> list[dict]:
    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{name}: cannot read parquet: {exc}") from exc
    return [_placed(row, table_row(name, index)) for index, row in enumerate(rows)]


_READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def read_rows(path: PathLike, kind: str, where: bool = False) -> list[dict]:
    """Read a `.parquet` or `.jsonl` file and validate its rows against `kind`. A URL (s3://...) is
    read from its verified copy in the download cache (dare_core/object_cache.py); messages name the
    path or URL as given. `where`: each row keeps its `Place` in the file as `_where`, for the
    messages of later checks."""
    name = redact(path) if is_remote(path) else str(Path(path))
    suffix = Path(name).suffix
    reader = _READERS.get(suffix)
    if reader is None:
        raise DataError(f"{name}: unsupported format '{suffix}', expected one of {sorted(_READERS)}")
    if is_remote(path):
        try:
            local = local_copy(path, "data file", folder=False)
        except RemoteError as exc:
            raise DataError(str(exc)) from None
    else:
        local = Path(path)
        if local.is_dir():
            raise DataError(f"{name}: is a directory, not a {suffix} file")
        if not local.exists():
            raise DataError(f"data file not found: {name}")
        if not local.is_file():
            raise DataError(f"{name}: not a regular file")
    try:
        rows = reader(local, name)
    except OSError as exc:
        raise DataError(f"{name}: cannot read ({exc.strerror or exc})") from None
    validate_rows(rows, kind, name)
    if not where:  # rows handed to training hold the file's columns only (a user's reward sees them)
        for row in rows:
            del row["_where"]
    return rows


def write_rows(path: PathLike, rows: Iterable[dict], kind: str) -> None:
    """Validate, then write the schema's columns as parquet in one atomic replace."""
    rows = list(rows)
    schema = get_schema(kind)
    validate_rows(rows, kind, str(path))
    columns = [c for c in schema.columns if c in schema.required or any(c in r for r in rows)]
    arrow_schema = pa.schema([(c, pa.string()) for c in columns])
    table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows], schema=arrow_schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(path, buf.getvalue())
