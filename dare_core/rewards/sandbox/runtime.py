"""The interpreter a jail runs: its own copy, made for that jail alone.

Every file a jail can read, but for /dev's character devices and its /proc, is a private copy in
the jail's own root tmpfs, written by bubblewrap (`--file`) inside the jail's cgroup, which pays for
it in memory and CPU time. Nothing of the host's interpreter is bound into a jail, so no two jails
(the two of one run, the rows of one call, the calls that follow) share an inode through it: a lock,
an inotify watch, an access time or the page-cache residency of one of these files belongs to the
jail that holds it and dies with it. What no copy can close (/dev's nodes, global counters) seccomp
closes (`dare_core.rewards.sandbox.seccomp`); docs/sandbox.md says why both.

A copy must be cheap, since every jail makes one, so the image holds only what a run can use:

- `/py/bin/python3`, its ELF loader at the loader's own path, and the shared libraries it and the
  kept extension modules load (found once with `ldd`), in `/py/lib`;
- the extension modules in `/py/lib/lib-dynload`, less test modules and those that need what a jail
  never has (a terminal, Tk, NIS, OpenSSL: `hashlib` keeps its built-in hashes);
- the standard library as one zip of compiled modules, `/py/lib/stdlib.zip`, less its test suites,
  IDLE, Tk, turtle, lib2to3, distutils, ensurepip, venv, pydoc and curses (and `site-packages`,
  `libpython*.a` and the other build files, which are no modules). `/py/bin/python3._pth` names
  the zip and `lib-dynload` as the whole module path.

ELF files are cut after their last loaded segment (their debugging sections go: libpython shrinks
from 22 to 5.5 MB here) and the compiled modules name their jail path, never the host's. The image
is built once per process and kept in sealed memfds; each jail's bubblewrap reads its own fresh
descriptors of them (`open_for_jail`), so jails that start at once never share a file offset.
"""
from __future__ import annotations

import fcntl
import importlib.machinery
import importlib.util
import io
import marshal
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import threading
import types
import zipfile
from dataclasses import dataclass
from typing import Optional

from dare_core.rewards.sandbox.unavailable import SandboxUnavailable

PYTHON = "/py/bin/python3"
LIB = "/py/lib"
STDLIB_ZIP = f"{LIB}/stdlib.zip"
DYNLOAD = f"{LIB}/lib-dynload"
# packages and modules of the standard library that no run uses: test suites, GUI and terminal
# toolkits whose native parts are not copied, packaging and documentation tools
_DROPPED = {"test", "idlelib", "tkinter", "turtledemo", "turtle", "ensurepip", "lib2to3", "distutils", "venv",
            "pydoc", "pydoc_data", "curses", "antigravity", "__phello__", "__hello__"}
_TEST_DIRS = {"test", "tests", "idle_test"}
# extension modules for tests or for what a jail lacks (Tk, a terminal, NIS, dbm files, OpenSSL's 5 MB)
_DROPPED_EXTENSIONS = re.compile(r"^(_test|_xxtest|_xxsub|_xxinterp|xxlimited|xxsubtype|_ctypes_test|_tkinter|"
                                 r"_curses|readline|nis|ossaudiodev|spwd|_ssl|_hashlib|_dbm|_gdbm|_crypt)")
_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")
_PAGE = 4096


@dataclass(frozen=True)
class RuntimeFile:
    path: str  # in the jail
    mode: int
    fd: int  # the sealed template, a memfd of this process
    size: int


@dataclass(frozen=True)
class RuntimeImage:
    files: tuple["RuntimeFile", ...]
    directories: tuple[str, ...]  # to create first, parents before children
    bytes: int  # what one jail's copy takes in its tmpfs (whole pages)


def _loadable(data: bytes) -> bytes:
    """An ELF file cut after the last byte its program headers cover, without section headers:
    what the loader maps, without the debugging sections. Anything else is returned as it is."""
    # 64-bit little-endian only: the architectures the seccomp filter knows (x86_64, aarch64)
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return data
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    end = phoff + phentsize * phnum
    for i in range(phnum):
        offset, filesz = struct.unpack_from("<Q8x8xQ", data, phoff + i * phentsize + 8)
        end = max(end, offset + filesz)
    if end >= len(data):
        return data
    header = bytearray(data[:64])
    struct.pack_into("<Q", header, 0x28, 0)  # e_shoff
    struct.pack_into("<HH", header, 0x3C, 0, 0)  # e_shnum, e_shstrndx
    return bytes(header) + data[64:end]


def _shared_libraries(files: list[str]) -> tuple[str, list[str]]:
    """(loader, libraries) that `files` load, from one `ldd` run."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("the sandbox needs `ldd` to find the interpreter's shared libraries")
    done = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60, env={"LC_ALL": "C"})
    loader, libraries = None, []
    for line in done.stdout.splitlines():
        match = _LDD_LINE.match(line)
        if not match:
            continue
        path = match.group(1)
        if "=>" not in line and os.path.basename(path).startswith("ld-"):
            loader = path
        elif path not in libraries:
            libraries.append(path)
    if loader is None:
        raise SandboxUnavailable(f"cannot find the ELF loader of {files[0]} (ldd said: {done.stderr.strip()[:200]})")
    return loader, libraries


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_with_filename(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _compiled(source: str, jail_name: str) -> bytes:
    """The module at host path `source` compiled, as a .pyc whose code names `jail_name`: the host's
    cached .pyc when it matches the source, else compiled here."""
    with open(source, "rb") as f:
        text = f.read()
    stat = os.stat(source)
    code = None
    try:
        with open(importlib.util.cache_from_source(source), "rb") as f:
            cached = f.read()
        flags, = struct.unpack_from("<I", cached, 4)
        if cached[:4] == importlib.util.MAGIC_NUMBER and (
                (flags == 0 and struct.unpack_from("<II", cached, 8) == (int(stat.st_mtime) & 0xFFFFFFFF,
                                                                          stat.st_size & 0xFFFFFFFF))
                or (flags & 1 and (not flags & 2 or cached[8:16] == importlib.util.source_hash(text)))):
            code = marshal.loads(cached[16:])
    except (OSError, ValueError, EOFError, struct.error):
        pass
    if code is None:
        code = compile(text, jail_name, "exec", dont_inherit=True)
    # no mtime check against a source (the zip holds none): an unchecked hash-based .pyc
    return importlib.util.MAGIC_NUMBER + struct.pack("<I", 1) + bytes(8) + marshal.dumps(_with_filename(code, jail_name))


def _stdlib_zip(stdlib: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for root, dirs, files in os.walk(stdlib):
            relative = os.path.relpath(root, stdlib)
            parts = [] if relative == "." else relative.split(os.sep)
            # only packages hold modules: config-*/, lib-dynload/ and site-packages/ are no packages
            dirs[:] = sorted(d for d in dirs if d not in _TEST_DIRS and not (not parts and d in _DROPPED)
                             and os.path.isfile(os.path.join(root, d, "__init__.py")))
            for name in sorted(files):
                if not name.endswith(".py") or (not parts and name[:-3] in _DROPPED):
                    continue
                member = "/".join([*parts, name[:-3]]) + ".pyc"
                data = _compiled(os.path.join(root, name), f"{STDLIB_ZIP}/{member[:-1]}")
                archive.writestr(zipfile.ZipInfo(member, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return buffer.getvalue()


def _sealed(name: str, data: bytes) -> int:
    """A memfd holding `data` that nobody can change any more."""
    fd = os.memfd_create(f"dare-runtime-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _build() -> RuntimeImage:
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
    if not os.path.isfile(os.path.join(stdlib, "os.py")):
        raise SandboxUnavailable(f"no standard library at {stdlib}")
    dynload = os.path.join(stdlib, "lib-dynload")
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    modules = sorted(os.path.join(dynload, f) for f in (os.listdir(dynload) if os.path.isdir(dynload) else [])
                     if f.endswith(suffixes) and not _DROPPED_EXTENSIONS.match(f))
    loader, libraries = _shared_libraries([executable, *modules])
    contents = [(PYTHON, 0o755, executable), (loader, 0o755, loader)]
    contents += [(f"{LIB}/{os.path.basename(p)}", 0o644, p) for p in libraries]
    contents += [(f"{DYNLOAD}/{os.path.basename(p)}", 0o644, p) for p in modules]
    files, directories = [], set()
    try:
        for path, mode, source in contents:
            with open(source, "rb") as f:
                data = _loadable(f.read())
            files.append(RuntimeFile(path, mode, _sealed(os.path.basename(path), data), len(data)))
        for path, data in ((STDLIB_ZIP, _stdlib_zip(stdlib)),
                           (f"{PYTHON}._pth", f"{os.path.relpath(STDLIB_ZIP, os.path.dirname(PYTHON))}\n"
                                              f"{os.path.relpath(DYNLOAD, os.path.dirname(PYTHON))}\n".encode())):
            files.append(RuntimeFile(path, 0o644, _sealed(os.path.basename(path), data), len(data)))
    except BaseException:
        for file in files:
            os.close(file.fd)
        raise
    for file in files:
        parent = os.path.dirname(file.path)
        while parent != "/":
            directories.add(parent)
            parent = os.path.dirname(parent)
    size = sum(-(-file.size // _PAGE) * _PAGE for file in files)
    return RuntimeImage(tuple(files), tuple(sorted(directories, key=lambda d: (d.count("/"), d))), size)


_LOCK = threading.Lock()
_IMAGE: Optional[RuntimeImage] = None


def runtime_image() -> RuntimeImage:
    """This process's image (built at the first call, about 0.2 s)."""
    global _IMAGE
    with _LOCK:
        if _IMAGE is None:
            _IMAGE = _build()
        return _IMAGE


def open_for_jail(image: RuntimeImage) -> list[tuple[int, RuntimeFile]]:
    """A descriptor of every file of the image for one bubblewrap, each its own open file at
    offset 0 (bubblewrap reads a descriptor to its end: two jails must not share one). The caller
    closes them once bubblewrap has started."""
    opened: list[tuple[int, RuntimeFile]] = []
    try:
        for file in image.files:
            opened.append((os.open(f"/proc/self/fd/{file.fd}", os.O_RDONLY | os.O_CLOEXEC), file))
    except BaseException:
        for fd, _ in opened:
            os.close(fd)
        raise
    return opened
