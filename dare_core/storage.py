"""Artifact paths and atomic writes.

Readers must never see half a checkpoint or half a parquet file: everything is written next to its
destination under a temporary name and renamed into place (rename is atomic on one filesystem).
Remote paths (s3://...) go through fsspec, where an object PUT is already all-or-nothing.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator, Union

from dare_core.errors import UserError
from dare_core.ownership import check_replaceable, files_under, mark

PathLike = Union[str, Path]


def is_remote(path: PathLike) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def _local(path: PathLike) -> Path:
    s = str(path)
    return Path(s[len("file://"):] if s.startswith("file://") else s)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status), else
    by setting and restoring it (a moment in which another thread would create files with 0o022)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(fd: int) -> None:
    """Give a file made by tempfile.mkstemp (always 0600) the mode an ordinary open() would have:
    the outputs of a stage must be readable by whoever may read the user's other files."""
    os.fchmod(fd, 0o666 & ~current_umask())


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    if is_remote(path):
        import fsspec

        with fsspec.open(str(path), "wb") as f:
            f.write(data)
        return
    path = _local(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            follow_umask(f.fileno())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj: Any, sort_keys: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


@contextlib.contextmanager
def atomic_dir(path: PathLike, writes: Iterable[str] = (), claim: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` in one rename.

    On an exception the temporary directory is removed and `path` is left as it was. `writes` and
    `claim`: as for `atomic_dirs`.
    """
    with atomic_dirs(path, writes=writes, claim=claim) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_dirs(*paths: PathLike, writes: Iterable[str] = (), claim: bool = True) -> Iterator[list[Path]]:
    """`atomic_dir` for outputs that belong together (prepared data and its tokenizer): one temporary
    sibling per path, swapped in one after the other only once all are written; a failed swap puts
    back the ones already done, so the outputs are all new or all old. An OSError (disk full,
    read-only) becomes a UserError naming the output.

    Only folders DARE wrote are replaced (ownership.py): each new folder gets the marker, and an
    existing one without it must be empty or hold only files matching `writes` (patterns of what
    the caller writes there; checked before the caller writes anything) or, at the swap, files the
    new folder holds too. `claim=False`: a folder of DARE's own cache, neither marked nor checked."""
    targets = [_local(p) for p in paths]
    writes = tuple(writes)
    if claim and writes:
        for path in targets:
            check_replaceable(path, writes)
    tmps: list[Path] = []
    try:
        for path in targets:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmps.append(path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
            tmps[-1].mkdir()
        yield list(tmps)
        if claim:
            for path, tmp in zip(targets, tmps):
                # what the old folder holds beyond the new one's files would be lost with it
                check_replaceable(path, writes + tuple(glob.escape(f) for f in files_under(tmp)))
                mark(tmp)
        _swap_in(targets, tmps)
    except OSError as exc:
        raise UserError(f"writing {', '.join(map(str, targets))} failed, nothing was changed: {exc}") from exc
    finally:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(targets: list[Path], tmps: list[Path]) -> None:
    done: list[tuple[Path, Path | None]] = []  # (target, its previous version moved aside)
    try:
        for path, tmp in zip(targets, tmps):
            old = None
            if path.exists():
                old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(path, old)
            try:
                os.replace(tmp, path)
            except OSError:
                if old is not None:
                    os.replace(old, path)
                raise
            done.append((path, old))
    except OSError:
        for path, old in reversed(done):
            shutil.rmtree(path, ignore_errors=True)
            if old is not None:
                os.replace(old, path)
        raise
    for _, old in done:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class DuplicateKeyError(ValueError):
    """A mapping that names one key twice: YAML keeps the last silently, so the first setting would
    be lost without a word."""


@functools.cache
def _unique_key_loader() -> type:
    import yaml  # (here: most users of this module never read YAML)

    class UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping (a `<<` merge may still be
        overridden, as YAML intends)."""

        def __init__(self, text: str, prefix: str) -> None:
            super().__init__(text)
            # the dotted key of each mapping node: a parent is constructed before its children (they
            # wait in state generators), so a mapping finds its path here, set by its parent
            self.dare_key_of: dict[int, str] = {}
            self.dare_root_key = prefix

        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            where = self.dare_key_of.get(id(node), self.dare_root_key)
            first_line: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (list, dict)):
                    continue  # unhashable: SafeLoader refuses it below, in its own words
                dotted = f"{where}.{key}" if where else str(key)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise DuplicateKeyError(f"line {line}: duplicate key '{dotted}' (first at line {first_line[key]}); "
                                            f"YAML would keep only the last, so remove one")
                first_line[key] = line
                self.dare_key_of[id(value_node)] = dotted
            return super().construct_mapping(node, deep)

        def construct_sequence(self, node: yaml.SequenceNode, deep: bool = False) -> list:
            where = self.dare_key_of.get(id(node), self.dare_root_key)
            for index, item in enumerate(node.value):
                self.dare_key_of[id(item)] = f"{where}[{index}]"
            return super().construct_sequence(node, deep)

    return UniqueKeyLoader


def load_yaml(text: str, prefix: str = "") -> Any:
    """The YAML document `text`, read the way DARE reads every settings file (params.yaml, a recipe,
    a `-S` value): safe types only, and a key given twice in one mapping is a DuplicateKeyError
    naming its line and dotted key (under `prefix`: the key a `-S` value is set at)."""
    loader = _unique_key_loader()(text, prefix)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_mapping(path: PathLike, error: type = UserError, what: str = "a mapping") -> dict:
    """The YAML mapping in `path` ({} for an empty file); unreadable, not YAML, a key given twice or
    not a mapping raises `error` naming the file."""
    import yaml

    path = _local(path)
    try:
        tree = load_yaml(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read ({exc})") from exc
    except DuplicateKeyError as exc:
        raise error(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(tree, dict):
        raise error(f"{path}: expected {what}, got {type(tree).__name__}")
    return tree


def read_json(path: PathLike, error: type = UserError) -> Any:
    """The JSON document in `path`; anything wrong with it (unreadable, not UTF-8, not JSON) raises
    `error` naming the file."""
    path = _local(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: invalid JSON ({exc})") from exc


def read_records(path: PathLike) -> list[dict]:
    """The rows of a JSON-lines record DARE wrote (a stage's metrics.jsonl, validation.jsonl); blank
    lines skipped (a record without rows holds one: training/metrics.end_without_rows); none for a
    missing file."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- checks before a stage writes anything ---------------------------------------------------------


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_problem(path: Path) -> str | None:
    """Why `path` (an existing file or folder) cannot be written, or None."""
    if os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
        return None
    read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    return "read-only file system" if read_only else "permission denied"


def check_writable(path: PathLike) -> None:
    """Raise UserError unless `path` (a file or folder a stage creates, replaces or writes into) can
    be written: the folder that holds it, and `path` itself where it exists. os.access also answers
    for root (a read-only mount, an immutable folder), unlike the permission bits."""
    if is_remote(path):
        return
    path = _local(path)
    holder = _existing_ancestor(path.parent)
    if not holder.is_dir():
        raise UserError(f"cannot write {path}: {holder} is not a directory")
    for existing in ([path] if path.exists() else []) + [holder]:
        problem = _write_problem(existing)
        if problem:
            where = "" if existing == path else f" (in {existing})"
            raise UserError(f"cannot write {path}{where}: {problem}")


def check_free_space(needs: list[tuple[PathLike, int]], what: str) -> None:
    """Raise UserError unless each file system has room for the bytes to be written there
    (`needs`: (where, bytes); paths on one file system add up)."""
    by_device: dict[int, tuple[Path, int]] = {}
    for where, nbytes in needs:
        if is_remote(where):
            continue
        holder = _existing_ancestor(_local(where))
        device = holder.stat().st_dev
        first, total = by_device.get(device, (holder, 0))
        by_device[device] = (first, total + nbytes)
    for holder, nbytes in by_device.values():
        stats = os.statvfs(holder)
        free = stats.f_bavail * stats.f_frsize
        if free < nbytes:
            raise UserError(f"not enough free disk space in {holder} for {what}: about {nbytes} bytes needed, "
                            f"{free} free")
