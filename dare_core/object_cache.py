"""The download cache of object-storage inputs: one per project, content-addressed, shared by the
workspaces of its isolated runs and kept when they are pruned.

Where a setting names a remote input, the stage reads `local_copy(url)`. The cache lies under
`remote.cache_root()`: the project's `.cache/remote`, which for a workspace of an isolated run is
its checkout's (pruning removes a workspace's git worktree, never this), or `$DARE_CACHE_DIR`.

- `objects/<2 hex>/<sha256>`: each object's bytes once, named by what identifies its content: its
  MD5 and size where the store gives the MD5 (an S3 single-part ETag, a GCS md5Hash), so the same
  bytes under two URLs, or an object changed and changed back, are fetched once; else its URL, ETag
  and size (a multipart ETag, a modification time: not a content hash). Downloaded under a temporary
  name, verified (size, MD5), made read-only and renamed into place; `<sha256>.json` beside it holds
  its size and mtime, so one edited in place since is noticed and fetched again.
- `<protocol>/<bucket>/<key>` (`remote.cache_path`): what a stage reads, the object, or for a
  prefix (a model folder) the folder of its objects: hard links to the objects (copies where the
  file system has none), replaced in one rename.

A copy is reused while the store lists the same size and ETag for every object and the copy's files
are as they were made (size and mtime, in `.manifests/`): another run, in any workspace, lists the
objects and downloads nothing. A changed object is fetched again; the others stay. Two locks: the
URL's, for the whole of a fetch (the ranks of a job, and runs at once, wait and then reuse the
copy), and the store's, held only while objects are put in place, copies linked and objects that
no copy links any more deleted (a model replaced in the store leaves no old weights behind), never
during a download.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

from dare_core.remote import (cache_path, cache_root, describe, file_lock, listing, manifest_path, redact,
                              remote_errors, remote_fs, verify)
from dare_core.storage import PathLike, _local, atomic_dir, atomic_write_json, is_remote

log = logging.getLogger(__name__)

STORE_LOCK = "object-store"  # the file_lock of `objects/` (module docstring)


def object_key(url: str, rel: str, entry: dict) -> str:
    """The name of the content of `url`'s object `rel` (a `listing` entry) in `objects/`."""
    if entry.get("md5"):
        identity = f"md5:{entry['md5']}:{entry['size']}"
    else:  # an ETag that is no content hash may be shared by other objects: the URL tells them apart
        identity = f"{redact(url).rstrip('/')}/{rel}\n{entry['etag']}\n{entry['size']}"
    return hashlib.sha256(identity.encode()).hexdigest()


def object_path(key: str) -> Path:
    return cache_root() / "objects" / key[:2] / key


def _sidecar(key: str) -> Path:
    return object_path(key).with_name(key + ".json")


def _stat(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _intact(key: str) -> bool:
    """The object is in place and as it was put there."""
    try:
        return json.loads(_sidecar(key).read_text()) == _stat(object_path(key))
    except (OSError, ValueError):
        return False


def _install(key: str, tmp: Path) -> None:
    """Put a verified download (or a copy's file, adopted) in place as object `key`."""
    where = object_path(key)
    where.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp, 0o444)  # the copies are hard links to it: an edit through one would change every copy
    os.replace(tmp, where)
    atomic_write_json(_sidecar(key), _stat(where))


def _adopt(path: Path, key: str) -> None:
    """Make a copy's file, as it was made, object `key` again: a copy whose object is gone (made by
    a DARE that kept none, or deleted by hand) is not downloaded again."""
    tmp = cache_root() / "objects" / f".{key}.{uuid.uuid4().hex[:8]}.adopt"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    _link(path, tmp)
    _install(key, tmp)


def _read_manifest(url: str) -> dict:
    try:
        return json.loads(manifest_path(url).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return {}


def _reusable(dest: Path, files: dict, remote: dict[str, dict]) -> set[str]:
    """The files of the copy that still match the remote object and are as they were made."""
    ok = set()
    for rel, entry in remote.items():
        had = files.get(rel)
        local = dest / rel if rel else dest
        if (had and (had["size"], had["etag"]) == (entry["size"], entry["etag"]) and local.is_file()
                and _stat(local) == {"size": had["size"], "mtime_ns": had.get("mtime_ns")}):
            ok.add(rel)
    return ok


def _local_files(dest: Path) -> set[str]:
    return {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} if dest.is_dir() else set()


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links on this file system
        shutil.copy2(src, dst)


def _make_copy(dest: Path, keys: dict[str, str]) -> None:
    """`dest` as hard links to the objects `keys` ({path in the prefix, "" for one object: key}),
    replaced in one rename."""
    if set(keys) == {""}:
        if dest.is_dir():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.part"
        _link(object_path(keys[""]), tmp)
        os.replace(tmp, dest)
        return
    if dest.exists() and not dest.is_dir():
        dest.unlink()
    with atomic_dir(dest, claim=False) as tmp:  # the download cache: DARE's own, never a user's folder
        for rel, key in keys.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            _link(object_path(key), tmp / rel)


def _fetch(url: str, remote: dict[str, dict], rels: list[str], keys: dict[str, str], what: str) -> dict[str, Path]:
    """Download `rels` of `url` to temporary files beside the objects, verified: {rel: file}."""
    incoming = cache_root() / "objects" / ".incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    tmps = {rel: incoming / f"{keys[rel]}.{uuid.uuid4().hex[:8]}.part" for rel in rels}
    fs, rpath = remote_fs(url)
    try:
        with remote_errors(url, "downloading it", what):
            fs.get([f"{rpath}/{rel}" if rel else rpath for rel in rels], [str(tmps[rel]) for rel in rels])
        for rel in rels:
            verify(tmps[rel], remote[rel], f"{url.rstrip('/')}/{rel}" if rel else url)
    except BaseException:
        _discard(tmps.values())
        raise
    return tmps


def _discard(paths) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _drop_unlinked(keys: set[str]) -> None:
    """Delete the objects among `keys` that no copy links any more."""
    for key in keys:
        with contextlib.suppress(FileNotFoundError):
            if object_path(key).stat().st_nlink == 1:
                object_path(key).unlink()
                _sidecar(key).unlink(missing_ok=True)


def local_copy(source: PathLike, what: str = "file", folder: Optional[bool] = None) -> Path:
    """`source` as a local path: a local path as it is (`file://` stripped), a URL as its verified
    copy in the download cache (module docstring). `what` names the input in messages ("data file",
    "model folder"); `folder` True/False insists on a prefix / a single object. Failures raise
    RemoteError naming the URL, never a credential."""
    if not is_remote(source):
        return _local(source)
    url = str(source)
    dest = cache_path(url)
    with file_lock(url):
        remote = listing(url, what, folder)
        made = _read_manifest(url)
        intact = _reusable(dest, made, remote)
        if intact == set(remote) and (set(remote) == {""} or _local_files(dest) == set(remote)):
            return dest
        keys = {rel: object_key(url, rel, entry) for rel, entry in remote.items()}
        fetched: dict[str, Path] = {}
        try:
            while True:  # twice at most: what is missing is fetched outside the store's lock
                with file_lock(STORE_LOCK):
                    for rel, tmp in fetched.items():
                        _install(keys[rel], tmp)
                    for rel in intact - {r for r in remote if _intact(keys[r])}:
                        _adopt(dest / rel if rel else dest, keys[rel])
                    missing = sorted(rel for rel in remote if not _intact(keys[rel]))
                    if not missing:
                        _make_copy(dest, keys)
                        files = {rel: {**e, "object": keys[rel], **_stat(dest / rel if rel else dest)}
                                 for rel, e in remote.items()}
                        atomic_write_json(manifest_path(url), {"url": redact(url), "files": files})
                        _drop_unlinked({e.get("object") for e in made.values()} - set(keys.values()) - {None})
                        break
                intact, fetched = set(), {}  # (those installed are gone from their temporary names)
                fetched = _fetch(url, remote, missing, keys, what)
                kept = len(remote) - len(missing)
                log.info("downloaded %s -> %s (%s%s)", redact(url), dest,
                         describe(len(missing), sum(remote[r]["size"] for r in missing)),
                         f"; {kept} already in the cache" if kept else "")
        finally:
            _discard(fetched.values())
    return dest
