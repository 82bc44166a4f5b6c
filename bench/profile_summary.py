"""The arithmetic of bench/profile_step.py, apart from any GPU: which kind of work a kernel is
(`kernel_category`), the kernels of a torch-profiler trace (`trace_activities`), their per-name
totals (`KernelTable`, which subtract and scale: one denoising step is two blocks' decoding less one
block's, over the block's steps) and a table's summary (`summarize`): the top kernels by GPU time,
and the wall time split into GEMM, attention, sampling, copies, other kernels and launch gaps (the
wall time with no kernel running)."""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

CATEGORIES = ("gemm", "attention", "sampling", "copy", "other")
GAPS = "launch_gaps"
SHARES = CATEGORIES + (GAPS,)

# Substrings of lower-cased kernel (GPU) or operator (CPU) names, tried in this order: attention
# first, since its fused kernels also name their GEMM library ("fmha_cutlassF", cuDNN's "xmma");
# sampling before copies, since top-k's kernels gather ("gatherTopK").
_ATTENTION = ("flash", "fmha", "attention", "attn", "sdpa")
_GEMM = ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "splitkreduce", "triton_mm")
_GEMM_OPS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "mv", "dot"}  # whole words (CPU operators, Inductor templates)
# softmax-family reductions over the logits, the random draws of Gumbel-max, and the selection of
# positions; an elementwise kernel of the Gumbel arithmetic (log, pow, div) cannot be told apart
# from any other by its name and counts as "other"
_SAMPLING = ("softmax", "logsumexp", "gumbel", "exponential", "uniform", "distribution", "bernoulli", "multinomial",
             "argmax", "argmin", "topk", "sort", "scan", "cumsum")
_COPY = ("copy", "memcpy", "memset", "fill", "index", "gather", "scatter", "concat")
_COPY_OPS = {"cat"}


def _words(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", name))


def kernel_category(name: str) -> str:
    """The kind of work a GPU kernel (or, on the CPU, a leaf operator) does, one of CATEGORIES, from
    its name. Inductor's templates ("triton_tem_...") are GEMMs where they name a matmul and
    FlexAttention otherwise (the one template DARE runs without max-autotune, named only by what it
    fused); Inductor's fused pointwise and reduction kernels list every op they fused (a `_to_copy`
    cast among them), so they are never copies: sampling where a sampling op is among them, else other."""
    low = name.lower()
    words = _words(low)
    if low.startswith("triton_tem"):
        return "gemm" if words & _GEMM_OPS else "attention"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if any(k in low for k in _GEMM) or words & _GEMM_OPS:
        return "gemm"
    if any(k in low for k in _SAMPLING):
        return "sampling"
    if low.startswith("triton_"):
        return "other"
    if any(k in low for k in _COPY) or words & _COPY_OPS:
        return "copy"
    return "other"


@dataclass(frozen=True)
class Activity:
    """One kernel run (or a piece of a CPU operator's own time): its name, start and duration in
    microseconds, and the runs it counts for (an operator cut into pieces counts once)."""

    name: str
    start_us: float
    dur_us: float
    calls: int = 1


GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_trace(path: Path) -> dict:
    """A Chrome trace written by `torch.profiler.profile.export_chrome_trace` (gzipped where `.gz`)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def trace_activities(trace: dict, gpu: bool) -> list[Activity]:
    """The work in a trace. On a GPU: its kernels, copies and memsets (kernels replayed from a CUDA
    graph are there one by one). On the CPU, which has no kernels: every operator's own time, the
    pieces of its interval that no operator inside it covers (`aten::mm` calls `aten::empty` for its
    output: counting leaf operators only would leave the GEMM out, counting whole ones would count
    nested time twice)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if gpu:
        return [Activity(e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") in GPU_EVENTS]
    threads: dict[tuple, list] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    return [piece for ops in threads.values() for piece in _own_time(ops)]


def _own_time(ops: list[dict]) -> list[Activity]:
    """The operators of one thread (nested intervals) cut into the pieces each runs itself."""
    pieces: list[Activity] = []
    stack: list[list] = []  # [name, end, cursor: where its own time resumes, runs not yet counted]

    def own(entry: list, upto: float) -> None:
        """The entry's own time from its cursor to `upto` (its run counted with its first piece)."""
        if upto > entry[2] or (entry[3] and upto == entry[1]):
            pieces.append(Activity(entry[0], entry[2], max(upto - entry[2], 0.0), entry[3]))
            entry[3] = 0
        entry[2] = max(entry[2], upto)

    def close() -> None:
        entry = stack.pop()
        own(entry, entry[1])
        if stack:
            stack[-1][2] = max(stack[-1][2], entry[1])

    for op in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):  # outer operators first
        start, end = float(op["ts"]), float(op["ts"]) + float(op["dur"])
        while stack and stack[-1][1] <= start:
            close()
        if stack:  # the enclosing operator's own time up to here; its end bounds this one's
            own(stack[-1], start)
            end = min(end, stack[-1][1])
        stack.append([op["name"], end, start, 1])
    while stack:
        close()
    return pieces


def busy_us(activities: Iterable[Activity]) -> float:
    """Microseconds in which at least one activity runs (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for a in sorted(activities, key=lambda a: a.start_us):
        stop = a.start_us + a.dur_us
        if stop > end:
            total += stop - max(a.start_us, end)
            end = stop
    return total


@dataclass
class KernelTable:
    """Per kernel name: [launches, GPU microseconds]; with the busy time (union of the kernels) and the
    wall time of the same work. Tables subtract and scale name by name, so the difference of two runs
    is the work the longer one did more (names whose difference is negative are run-to-run noise)."""

    kernels: dict[str, list[float]] = field(default_factory=dict)
    busy_us: float = 0.0
    wall_us: float = 0.0

    @classmethod
    def of(cls, activities: list[Activity], wall_us: float) -> "KernelTable":
        kernels: dict[str, list[float]] = {}
        for a in activities:
            entry = kernels.setdefault(a.name, [0.0, 0.0])
            entry[0] += a.calls
            entry[1] += a.dur_us
        return cls(kernels, busy_us(activities), wall_us)

    def minus(self, other: "KernelTable") -> "KernelTable":
        names = list(self.kernels) + [n for n in other.kernels if n not in self.kernels]
        zero = [0.0, 0.0]
        kernels = {n: [self.kernels.get(n, zero)[i] - other.kernels.get(n, zero)[i] for i in range(2)] for n in names}
        return KernelTable(kernels, self.busy_us - other.busy_us, self.wall_us - other.wall_us)

    def scaled(self, factor: float) -> "KernelTable":
        return KernelTable({n: [c * factor, us * factor] for n, (c, us) in self.kernels.items()}, self.busy_us * factor,
                           self.wall_us * factor)

    def as_dict(self) -> dict:
        return {"kernels": self.kernels, "busy_us": self.busy_us, "wall_us": self.wall_us}


def summarize(table: KernelTable, top: int = 15) -> dict:
    """The table's wall, busy and kernel microseconds; microseconds per category; the shares of the
    wall time (GAPS: the wall time with no kernel running; the busy time split over the categories in
    proportion to their kernel time, which is the same where kernels never overlap), which sum to 1;
    and the `top` kernels by GPU time with their share of the kernel time."""
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    for name, (_, us) in table.kernels.items():
        per_category[kernel_category(name)] += max(us, 0.0)
    kernel_us = sum(per_category.values())
    busy = max(table.busy_us, 0.0)
    whole = max(table.wall_us, busy)  # (a wall time measured apart may come out a little under the busy time)
    shares = {c: (per_category[c] / kernel_us * busy / whole if kernel_us and whole else 0.0) for c in CATEGORIES}
    shares[GAPS] = (whole - busy) / whole if whole else 0.0
    ranked = sorted(table.kernels.items(), key=lambda item: -item[1][1])[:top]
    return {"wall_us": table.wall_us, "busy_us": table.busy_us, "kernel_us": kernel_us, "category_us": per_category,
            "shares": shares,
            "top": [{"name": n, "category": kernel_category(n), "calls": c, "us": us, "share": us / kernel_us if kernel_us else 0.0}
                    for n, (c, us) in ranked]}
