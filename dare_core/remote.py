"""Object storage: s3:// (or any fsspec URL) inputs, listed and fetched verified, and uploads.

Where a setting names a remote input (`data.source`, `data.eval_source`, `data.val_source`,
`data.preference_source`, `model.path`), the stage reads `object_cache.local_copy(url)`: its copy
in the project's download cache (`cache_root`), fetched through `listing` and checked by `verify`
(size, and the MD5 where the ETag is one), so a reader never sees a partial or unverified file.
`download_to` fetches a checkpoint the same way, straight into its folder.

Credentials, endpoint and region come from the backend's own standard configuration, never from
DARE's settings. For S3 that is botocore's: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN or AWS_PROFILE (~/.aws), AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (MinIO, moto,
other S3-compatible stores; s3fs passes no endpoint of its own, so botocore reads these) and
AWS_DEFAULT_REGION. They are never printed: every message that leaves here is `scrub`bed.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import logging
import os
import posixpath
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

from dare_core.process.env_file import project_of
from dare_core.errors import UserError
from dare_core.storage import PathLike, atomic_dir, is_remote

log = logging.getLogger(__name__)

CACHE_ENV = "DARE_CACHE_DIR"
DEFAULT_CACHE = Path(".cache") / "remote"
# "size": check downloads by size only. Objects encrypted with SSE-KMS or SSE-C have an ETag that
# is not the MD5 of their bytes, so the MD5 check would reject every correct download of them.
VERIFY_ENV = "DARE_REMOTE_VERIFY"
# what to check when a remote read or write is refused or cannot connect (names only, never values)
S3_SETTINGS = ("AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), AWS_SESSION_TOKEN, "
               "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and AWS_DEFAULT_REGION")
_SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS",
                "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS_TOKEN")


class RemoteError(UserError):
    """A remote input or output that cannot be read, written or verified; names the URL (without
    credentials) and what to check."""


# ---- messages without secrets -----------------------------------------------------------------


def redact(url: PathLike) -> str:
    """`url` without a user:password@ part or a query string (either may hold a credential)."""
    text = str(url)
    if not is_remote(text):
        return text
    parts = urlsplit(text)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return f"{parts.scheme}://{netloc}{parts.path}"


def scrub(text: str) -> str:
    """`text` with every credential it could hold replaced: the values of the credential
    variables, and user:password@ in URLs (error messages of the backends quote URLs)."""
    text = re.sub(r"://[^/@\s]+@", "://***@", str(text))
    for var in _SECRET_VARS:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def _backend_error(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore", "s3fs", "gcsfs", "adlfs", "aiohttp")


@contextlib.contextmanager
def remote_errors(url: PathLike, action: str, what: str = "object") -> Iterator[None]:
    """Turn a backend's failure while `action`ing `url` into a RemoteError naming the URL and the
    settings to check: a missing object, refused access, no credentials, no connection."""
    shown = redact(url)
    try:
        yield
    except RemoteError:
        raise
    except FileNotFoundError:
        raise RemoteError(f"{what} not found: {shown}") from None
    except PermissionError as exc:
        raise RemoteError(f"{shown}: access denied while {action} ({scrub(str(exc) or 'Forbidden')}); check "
                          f"the credentials and endpoint: {S3_SETTINGS}") from None
    except (OSError, TimeoutError) as exc:
        raise RemoteError(f"{shown}: {action} failed ({type(exc).__name__}: {scrub(str(exc))}); check the endpoint "
                          f"and credentials: {S3_SETTINGS}") from None
    except Exception as exc:
        if not _backend_error(exc):
            raise  # a bug, with its traceback
        raise RemoteError(f"{shown}: {action} failed ({type(exc).__name__}: {scrub(str(exc))}); check the endpoint "
                          f"and credentials: {S3_SETTINGS}") from None


def remote_fs(url: PathLike) -> tuple[Any, str]:
    """(filesystem, path inside it) for `url`. A new filesystem each time: fsspec's shared
    instances keep listings cached (a changed object would look unchanged) and credentials or an
    endpoint from when they were made."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(str(url), skip_instance_cache=True)
    except (ImportError, ValueError) as exc:  # an unknown protocol, or its backend is not installed
        raise RemoteError(f"{redact(url)}: no filesystem for this URL ({scrub(str(exc))})") from None
    return fs, path.rstrip("/") or path


# ---- the download cache --------------------------------------------------------------------------


def cache_root() -> Path:
    """`$DARE_CACHE_DIR`, else the project's `.cache/remote`: in a workspace of an isolated run, the
    checkout's (env_file.project_of), so that every run's workspace shares one copy of an input and
    pruning a workspace, which removes only its git worktree, keeps it."""
    return Path(os.environ.get(CACHE_ENV) or project_of(Path.cwd()) / DEFAULT_CACHE).absolute()


def _key_parts(url: str) -> list[str]:
    parts = urlsplit(url)
    names = [parts.netloc.rsplit("@", 1)[-1], *parts.path.split("/")]
    # no part may climb out of the cache ("..") or be empty
    return [n if n not in ("..", ".") else "_" for n in names if n]


def cache_path(url: PathLike) -> Path:
    """Where `object_cache.local_copy(url)` puts its copy (whether or not it is there yet)."""
    url = str(url)
    return cache_root().joinpath(urlsplit(url).scheme, *_key_parts(url))


def manifest_path(url: str) -> Path:
    where = cache_root().joinpath(".manifests", urlsplit(url).scheme, *_key_parts(url))
    return where.with_name(where.name + ".json")  # appended: with_suffix would map a.v2 and a.v3 to one file


@contextlib.contextmanager
def file_lock(name: str) -> Iterator[None]:
    """An exclusive lock shared by every process on this machine (the ranks of a job fetch one copy,
    the others wait for it and reuse it)."""
    path = cache_root() / ".locks" / (hashlib.sha1(name.encode()).hexdigest()[:20] + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _identity(info: dict) -> dict:
    """What identifies an object's version: its size, its ETag (or the backend's checksum or
    modification time), and the MD5 the download must have where the store gives one."""
    etag = next((info[k] for k in ("ETag", "etag", "md5Hash", "checksum", "mtime", "LastModified", "created")
                 if info.get(k) is not None), None)
    return {"size": int(info.get("size") or 0), "etag": None if etag is None else str(etag), "md5": _expected_md5(info)}


def _expected_md5(info: dict) -> Optional[str]:
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    # a single-part S3 upload's ETag is the MD5 of its bytes; a multipart upload's is the MD5 of
    # the parts' MD5s plus "-<parts>", which cannot be checked without the part size: size only
    if re.fullmatch(r"[0-9a-fA-F]{32}", etag):
        return etag.lower()
    if info.get("md5Hash"):  # GCS: base64 of the MD5
        with contextlib.suppress(ValueError):
            return base64.b64decode(info["md5Hash"]).hex()
    return None


def listing(url: PathLike, what: str = "object", folder: Optional[bool] = None) -> dict[str, dict]:
    """{path relative to `url` ("" for a single object): identity} of the object or prefix at
    `url`; `folder` True/False insists on a prefix / a single object."""
    url = str(url)
    fs, rpath = remote_fs(url)
    with remote_errors(url, "listing it", what):
        info = fs.info(rpath)
        if info.get("type") != "directory":
            if folder:
                raise RemoteError(f"{what} {redact(url)}: is a single object, not a folder (prefix)")
            return {"": _identity(info)}
        if folder is False:
            raise RemoteError(f"{what} {redact(url)}: is a folder (prefix), not a single object")
        found = fs.find(rpath, detail=True)
    entries = {posixpath.relpath(name, rpath): _identity(i) for name, i in found.items() if i.get("type") != "directory"}
    if not entries:
        raise RemoteError(f"{what} not found: {redact(url)} (an empty prefix)")
    return entries


def file_digest(path: Path, algorithm: str = "md5") -> str:
    """The hex digest of a file's bytes, read in 4 MiB chunks (a model shard never sits in memory)."""
    h = hashlib.new(algorithm)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, expected: dict, url: str) -> None:
    """Raise RemoteError unless the downloaded `path` has the listed size and, where known, MD5."""
    size = path.stat().st_size
    if size != expected["size"]:
        raise RemoteError(f"{redact(url)}: downloaded {size} bytes, the object store lists {expected['size']} (a broken "
                          f"transfer, or the object changed meanwhile); nothing was kept, run again")
    if expected.get("md5") and os.environ.get(VERIFY_ENV, "").lower() != "size":
        got = file_digest(path)
        if got != expected["md5"]:
            raise RemoteError(f"{redact(url)}: the download's MD5 {got} differs from the object's ETag {expected['md5']}; "
                              f"nothing was kept, run again (objects encrypted with SSE-KMS or SSE-C have ETags that "
                              f"are not MD5s: set {VERIFY_ENV}=size to check their size only)")


def download_to(url: str, dest: Path, remote: dict[str, dict], what: str = "object") -> None:
    """Fetch `remote` (a `listing` of `url`) into `dest`, verified, all or nothing: a single object
    into a temporary file renamed over `dest`, a prefix into a temporary folder that replaces
    `dest` in one rename."""
    fs, rpath = remote_fs(url)
    if set(remote) == {""}:
        if dest.is_dir():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.part"
        try:
            with remote_errors(url, "downloading it", what):
                fs.get_file(rpath, str(tmp))
            verify(tmp, remote[""], url)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        log.info("downloaded %s -> %s (%s)", redact(url), dest, describe(1, remote[""]["size"]))
        return
    if dest.exists() and not dest.is_dir():
        dest.unlink()
    names = sorted(remote)
    with atomic_dir(dest, claim=False) as tmp:  # a folder DARE fills itself (a checkpoint), never a user's
        for rel in names:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        with remote_errors(url, "downloading it", what):
            fs.get([f"{rpath}/{rel}" for rel in names], [str(tmp / rel) for rel in names])
        for rel in names:
            verify(tmp / rel, remote[rel], f"{url.rstrip('/')}/{rel}")
    log.info("downloaded %s -> %s (%s)", redact(url), dest, describe(len(names), sum(remote[r]["size"] for r in names)))


def describe(files: int, nbytes: int) -> str:
    """'12 files, 3.4 MB'."""
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            break
        size /= 1000
    shown = f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
    return f"{files} file{'s' if files != 1 else ''}, {shown}"
