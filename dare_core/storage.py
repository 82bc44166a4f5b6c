"""Artifact paths and atomic writes.

Readers must never see half a checkpoint or half a parquet file: everything is written next to its
destination under a temporary name and renamed into place (rename is atomic on one filesystem).
Remote paths (s3://...) go through fsspec, where an object PUT is already all-or-nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator, Union

PathLike = Union[str, Path]


def is_remote(path: PathLike) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def _local(path: PathLike) -> Path:
    s = str(path)
    return Path(s[len("file://"):] if s.startswith("file://") else s)


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
def atomic_dir(path: PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` in one rename.

    On an exception the temporary directory is removed and `path` is left as it was.
    """
    path = _local(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
