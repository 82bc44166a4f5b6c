"""The lmdeploy engine's process, seen from DARE's side (docs/sampling.md#engines): which python
runs it, starting and stopping it, one call at a time over a socket, and the policy's weights handed
over on the GPU.

The child (`child.py`) runs in lmdeploy's own environment (docs/environment.md#lmdeploy), on the
GPU this process uses, and ends when this process closes it or dies. A failure there comes back as
an error carrying the child's own traceback; a crash of the child (a segfault, the kernel's
out-of-memory killer) as one carrying the tail of its log.
"""
from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from dare_core.sampling.engines.lmdeploy.child import recv, send

CHILD = Path(__file__).with_name("child.py")
PROJECT = Path(__file__).resolve().parents[4]
# variables of a torch.distributed launch: the engine is one process on one GPU, not a rank
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")
MIN_VERSION = (0, 10, 2)  # SDAR landed in 0.10.1; from 0.10.2 the engine streams token-id increments
ALIGN = 256  # byte alignment of each tensor in the staging buffer (any dtype can be viewed there)
INSTALL_HINT = ("the lmdeploy rollout engine needs a CUDA GPU and lmdeploy 0.18 in its own environment: "
                "make lmdeploy (docs/environment.md#lmdeploy), or set DARE_LMDEPLOY_PYTHON to a python that imports it")


def engine_python(python: Optional[str] = None) -> str:
    """The python that runs the engine: `python` if given, else $DARE_LMDEPLOY_PYTHON, else the
    project's .venv-lmdeploy (made by `make lmdeploy`), else this one (an image where lmdeploy is
    importable beside DARE)."""
    if python:
        return python
    if os.environ.get("DARE_LMDEPLOY_PYTHON"):
        return os.environ["DARE_LMDEPLOY_PYTHON"]
    venv = PROJECT / ".venv-lmdeploy" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


@functools.lru_cache(maxsize=None)
def unavailable(python: Optional[str] = None) -> Optional[str]:
    """Why the engine cannot run here (None: it can): no CUDA GPU, or lmdeploy not importable (or
    too old) in the engine's python."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU here; {INSTALL_HINT}"
    exe = engine_python(python)
    try:
        probe = subprocess.run([exe, "-c", "import lmdeploy; print(lmdeploy.__version__)"], capture_output=True, text=True,
                               timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{exe} could not be run ({e}); {INSTALL_HINT}"
    if probe.returncode:
        return f"{exe} cannot import lmdeploy ({probe.stderr.strip().splitlines()[-1:]}); {INSTALL_HINT}"
    version = probe.stdout.strip()
    if tuple(int(p) for p in version.split(".")[:3] if p.isdigit()) < MIN_VERSION:
        return f"{exe} has lmdeploy {version}, older than {'.'.join(map(str, MIN_VERSION))}; {INSTALL_HINT}"
    return None


def child_environment(environ: dict, device: Optional[str]) -> dict:
    """The child's variables: this process's, less a distributed launch's, with only `device`
    (this process's GPU, as CUDA_VISIBLE_DEVICES names it) visible, so it is the child's cuda:0."""
    env = {k: v for k, v in environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC_")}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    env["PYTHONUNBUFFERED"] = "1"
    return env


def visible_device(index: int, environ: dict) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's device `index` (an id or UUID)."""
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if visible else str(index)


def weight_buckets(tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
                   ) -> Iterator[tuple[list[tuple[str, torch.Tensor, int]], int, bool]]:
    """([(name, tensor, byte offset)], bytes used, last?) groups of the streamed `tensors`, each
    fitting `max_bytes` with every offset a multiple of ALIGN; a larger tensor makes a group alone."""
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    bucket: list = []
    used = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        offset = -(-used // ALIGN) * ALIGN
        if bucket and offset + nbytes > max_bytes:
            yield bucket, used, False
            bucket, used, offset = [], 0, 0
        bucket.append((name, t, offset))
        used = offset + nbytes
    if bucket:
        yield bucket, used, True


class EngineDied(RuntimeError):
    pass


class EngineProcess:
    """The child running lmdeploy on this process's current GPU."""

    def __init__(self, python: Optional[str] = None, log_dir: Optional[Path] = None):
        self.python = engine_python(python)
        log_dir = Path(log_dir) if log_dir else Path(tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = Path(tempfile.mkstemp(prefix="dare-lmdeploy-", suffix=".log", dir=log_dir)[1])
        device = visible_device(torch.cuda.current_device(), os.environ) if torch.cuda.is_available() else None
        ours, theirs = socket.socketpair()
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([self.python, str(CHILD), str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=child_environment(dict(os.environ), device))
        theirs.close()
        self.conn = Connection(ours.detach())
        self._staging: Optional[torch.Tensor] = None
        self._staging_key = 0
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.conn)

    def call(self, op: str, **kwargs):
        """Send one request and wait for its reply (as long as the child lives)."""
        try:
            send(self.conn, {"op": op, **kwargs})
            while not self.conn.poll(0.5):
                if self.proc.poll() is not None:
                    raise EOFError
            reply = recv(self.conn)
        except (EOFError, OSError, BrokenPipeError):
            self.proc.wait(timeout=10)
            raise EngineDied(f"the lmdeploy engine process ({self.python}) exited with code {self.proc.returncode} "
                             f"during '{op}'; the end of its log {self.log}:\n{self.log_tail()}") from None
        if "error" in reply:
            raise RuntimeError(f"the lmdeploy engine process failed in '{op}' (log: {self.log}):\n{reply['error']}")
        return reply["ok"]

    def push_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> dict:
        """Hand checkpoint-named tensors to the engine through one staging buffer on this GPU,
        shared once over CUDA IPC and reused bucket after bucket; returns counts and seconds."""
        from torch.multiprocessing.reductions import reduce_tensor

        t0, count, buckets = time.perf_counter(), 0, 0
        device = torch.device("cuda", torch.cuda.current_device())
        for bucket, used, last in weight_buckets(tensors, max_bytes):
            handle = None
            if self._staging is None or self._staging.numel() < used:
                self._staging = None  # the old buffer goes before the larger one is made
                self._staging = torch.empty(max(used, max_bytes), dtype=torch.uint8, device=device)
                self._staging_key += 1
                handle = reduce_tensor(self._staging)
            layout = []
            for name, t, offset in bucket:
                nbytes = t.numel() * t.element_size()
                self._staging[offset:offset + nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                layout.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset))
            torch.cuda.current_stream(device).synchronize()  # the child reads the buffer from its own stream
            count += self.call("load_weights", key=self._staging_key, handle=handle, tensors=layout, finished=last)
            buckets += 1
        return {"tensors": count, "buckets": buckets, "seconds": time.perf_counter() - t0}

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        self._staging = None
        self._finalizer()


def _stop(proc: subprocess.Popen, conn: Connection) -> None:
    """Ask the child to close its engine; kill it if it does not end in time."""
    if proc.poll() is None:
        try:
            send(conn, {"op": "close"})
            proc.wait(timeout=60)
        except (OSError, EOFError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
    conn.close()
