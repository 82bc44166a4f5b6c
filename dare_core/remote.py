"""Object storage: s3:// (or any fsspec URL) inputs as verified local copies, and uploads.

Where a setting names a remote input (`data.source`, `data.eval_source`, `data.val_source`,
`data.preference_source`, `model.path`), the stage reads `local_copy(url)`: a copy in the download
cache, `$DARE_CACHE_DIR` or else `.cache/remote/` under the working directory (the project),
laid out as `<protocol>/<bucket>/<key>`. A copy is downloaded under a temporary name, checked
against the object store's listing (size, and the MD5 where the ETag is one) and renamed into
place, so a reader never sees a partial or unverified file. It is reused while the store still lists
the same size and ETag for every object and the local files keep the size and mtime recorded at the
download (a changed object is fetched again; a cached file edited or truncated since is fetched
again too). A folder (a model: config.json, shards, tokenizer files) is the whole prefix, refreshed
object by object: unchanged files are hard-linked into the new copy, which replaces the old one in
one rename.

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
import json
import logging
import os
import posixpath
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

from dare_core.errors import UserError
from dare_core.storage import PathLike, _local, atomic_dir, atomic_write_json, is_remote

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
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).absolute()


def _key_parts(url: str) -> list[str]:
    parts = urlsplit(url)
    names = [parts.netloc.rsplit("@", 1)[-1], *parts.path.split("/")]
    # no part may climb out of the cache ("..") or be empty
    return [n if n not in ("..", ".") else "_" for n in names if n]


def cache_path(url: PathLike) -> Path:
    """Where `local_copy(url)` puts its copy (whether or not it is there yet)."""
    url = str(url)
    return cache_root().joinpath(urlsplit(url).scheme, *_key_parts(url))


def _manifest_path(url: str) -> Path:
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


def _stat(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_manifest(url: str) -> dict:
    try:
        return json.loads(_manifest_path(url).read_text())
    except (OSError, ValueError):
        return {}


def _reusable(dest: Path, url: str, remote: dict[str, dict]) -> set[str]:
    """The files of the cached copy that still match the remote object and are as downloaded."""
    files = _read_manifest(url).get("files", {})
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


def local_copy(source: PathLike, what: str = "file", folder: Optional[bool] = None) -> Path:
    """`source` as a local path: a local path as it is (`file://` stripped), a URL as its verified
    copy in the download cache (fetched if missing, changed or tampered with). `what` names the
    input in messages ("data file", "model folder"); `folder` True/False insists on a prefix / a
    single object. Failures raise RemoteError naming the URL, never a credential."""
    if not is_remote(source):
        return _local(source)
    url = str(source)
    dest = cache_path(url)
    with file_lock(url):
        remote = listing(url, what, folder)
        keep = _reusable(dest, url, remote)
        single = set(remote) == {""}
        if keep == set(remote) and (single or _local_files(dest) == set(remote)):
            return dest
        download_to(url, dest, remote, keep, what)
        atomic_write_json(_manifest_path(url), {"url": redact(url), "files": {
            rel: {"size": e["size"], "etag": e["etag"], **_stat(dest / rel if rel else dest)} for rel, e in remote.items()}})
    return dest


def download_to(url: str, dest: Path, remote: dict[str, dict], keep: frozenset | set = frozenset(),
                what: str = "object") -> None:
    """Fetch `remote` (a `listing` of `url`) into `dest`, verified, all or nothing: a single object
    into a temporary file renamed over `dest`, a prefix into a temporary folder that replaces
    `dest` in one rename (the files named in `keep` hard-linked from the old `dest`)."""
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
    fetch = sorted(rel for rel in remote if rel not in keep)
    with atomic_dir(dest, claim=False) as tmp:  # the download cache: DARE's own, never a user's folder
        for rel in remote:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if rel in keep:
                try:
                    os.link(dest / rel, tmp / rel)
                except OSError:  # another file system, or no hard links there
                    shutil.copy2(dest / rel, tmp / rel)
        if fetch:
            with remote_errors(url, "downloading it", what):
                fs.get([f"{rpath}/{rel}" for rel in fetch], [str(tmp / rel) for rel in fetch])
        for rel in fetch:
            verify(tmp / rel, remote[rel], f"{url.rstrip('/')}/{rel}")
    log.info("downloaded %s -> %s (%s)", redact(url), dest,
             describe(len(fetch), sum(remote[r]["size"] for r in fetch)) + (f", {len(keep)} unchanged" if keep else ""))


def describe(files: int, nbytes: int) -> str:
    """'12 files, 3.4 MB'."""
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            break
        size /= 1000
    shown = f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
    return f"{files} file{'s' if files != 1 else ''}, {shown}"
