"""Streaming safetensors shards: a header planned from shapes alone, then each tensor written as
it is produced, from one background thread while the caller prepares the next (merges a LoRA
weight, copies it off the GPU). safetensors' own `save_file` wants every tensor in memory at once."""
from __future__ import annotations

import collections
import json
import math
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

# Hugging Face's default max_shard_size ("5GB")
SHARD_BYTES = 5 * 10**9

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def nbytes(shape: tuple, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_shards(layout: dict[str, tuple[tuple, torch.dtype]], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive runs of tensors (export order), each at most `max_shard_bytes` unless one tensor
    alone is larger: shards are written in the order the tensors are produced."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in layout.items():
        n = nbytes(shape, dtype)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_shard(path: Path, specs: list[tuple[str, tuple, torch.dtype]], tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """One safetensors file holding `specs` (name, shape, dtype), their data taken from `tensors` one
    at a time. The header is known from the specs alone, so each tensor is written as soon as it is
    produced (safetensors' own save_file wants them all in memory, then copies them once more).
    Returns where the time went: `produce_s` computing the tensors (a LoRA merge), `copy_s` taking
    them off the device, `disk_wait_s` waiting for the disk, `other_s` the rest (open, close)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        end = offset + nbytes(shape, dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # as safetensors pads it: the data starts 8-byte aligned
    # "xb", a new file: a file opened with O_TRUNC is flushed to the disk when it closes on ext4
    # (auto_da_alloc, its guard against truncate-and-rewrite), which is not what an export wants
    t_open = time.perf_counter()
    with open(path, "xb") as f, StreamWriter(f) as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        produce = copy = 0.0
        for name, shape, dtype in specs:
            t0 = time.perf_counter()
            got, t = next(tensors)
            t1 = time.perf_counter()
            if got != name or tuple(t.shape) != shape or t.dtype != dtype:
                raise RuntimeError(f"export: expected '{name}' {shape} {dtype}, the model gave '{got}' {tuple(t.shape)} {t.dtype}")
            wait = out.wait_s
            out.write_tensor(t)
            produce += t1 - t0
            copy += time.perf_counter() - t1 - (out.wait_s - wait)
    total = time.perf_counter() - t_open
    return {"produce_s": produce, "copy_s": copy, "disk_wait_s": out.wait_s, "other_s": total - produce - copy - out.wait_s}


class StreamWriter:
    """Writes to a file, in order, from one background thread while the caller prepares what comes
    next (merges the next weight, copies it off the GPU): the disk and the device work at once.

    A tensor on the host is written as it is (no copy). One on a GPU goes through two reused pinned
    buffers, chunk by chunk: the copy off the device is fast (pinned, no fresh pages to fault in)
    and the host holds two chunks, whatever the model's size."""

    CHUNK = 64 << 20
    IN_FLIGHT = 2

    def __init__(self, f):
        self.f = f
        self.pool = ThreadPoolExecutor(max_workers=1)  # one thread: writes land in submission order
        self.inflight: collections.deque[Future] = collections.deque()
        self.staging: list[torch.Tensor] = []
        self.staged: list[Optional[Future]] = []  # the write still reading each staging buffer
        self.turn = 0
        self.wait_s = 0.0  # seconds the caller stood waiting for the disk (export diagnostics)

    def _wait(self, future: Future) -> None:
        t = time.perf_counter()
        try:
            future.result()
        finally:
            self.wait_s += time.perf_counter() - t

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, *exc) -> None:
        try:
            while self.inflight:  # the file must not close under a pending write; its error surfaces here
                self._wait(self.inflight.popleft())
        finally:
            self.pool.shutdown(wait=True)

    def write(self, data) -> Future:
        while len(self.inflight) >= self.IN_FLIGHT:
            self._wait(self.inflight.popleft())
        future = self.pool.submit(self.f.write, data)
        self.inflight.append(future)
        return future

    def write_tensor(self, t: torch.Tensor) -> None:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            self.write(memoryview(flat.numpy()))
            return
        for start in range(0, flat.numel(), self.CHUNK):
            chunk = flat[start:start + self.CHUNK]
            buf = self._free_buffer()[:chunk.numel()]
            buf.copy_(chunk)
            self.staged[self.turn] = self.write(memoryview(buf.numpy()))

    def _free_buffer(self) -> torch.Tensor:
        """The next staging buffer, once the write reading it is done."""
        if not self.staging:
            self.staging = [torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.staged = [None, None]
        self.turn = 1 - self.turn
        if self.staged[self.turn] is not None:
            self._wait(self.staged[self.turn])
        return self.staging[self.turn]
