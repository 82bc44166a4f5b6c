"""What every benchmark's results file is stamped with (the commit, the machine, the libraries, the
date) and the small writing helpers they share (markdown tables, number cells, atomic writes)."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Iterable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The checkout's commit; DARE_COMMIT, when set, names it instead (a copy of the tree whose .git
    is absent or stale, as on the remote GPU machine). It must be a whole 40-digit hash, as
    `git rev-parse HEAD` prints it where the commit exists: a short one typed by hand can name a
    commit that is not there (a results file of 2026-11-27 named ff06b86e for ff06b86c)."""
    given = os.environ.get("DARE_COMMIT")
    if given:
        if not re.fullmatch(r"[0-9a-f]{40}", given):
            raise SystemExit(f"DARE_COMMIT={given!r}: give the whole hash, e.g. DARE_COMMIT=$(git rev-parse HEAD) "
                             "in the checkout where the commit exists")
        return given

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout here; set DARE_COMMIT)"
    return sha + (" + uncommitted changes" if dirty else "")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def library_versions(names: tuple[str, ...] = ("torch", "deepspeed", "opencompass", "peft", "prefect", "dvc")) -> str:
    """Python's version and the installed versions of the libraries a result depends on ("absent"
    where not installed)."""
    import platform
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return ", ".join([f"Python {platform.python_version()}"] + [f"{n} {version(n)}" for n in names])


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what `platform` knows)."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        return model


def usable_cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_memory_bytes() -> int:
    """The machine's RAM (0 where /proc/meminfo cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gpu_uuids() -> list[str]:
    """The UUIDs of this machine's GPUs, from nvidia-smi (no CUDA context is made: a bench's parent
    process leaves the GPUs to its runs); [] without GPUs. Two runs on the same GPUs name the same."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def hardware(gpu: bool = True, cpu_detail: bool = False) -> str:
    """The machine in one line: the GPU (name, memory) unless `gpu` is off or there is none, the host's
    cores and RAM (`cpu_detail`: also the CPU's model and the cores this process may use), torch, CUDA
    and DeepSpeed. train_step.py and multi_gpu.py compare this line between runs (--add, --merge), so
    the default wording stays as those runs recorded it."""
    import platform
    from importlib import metadata

    import torch

    try:
        ds = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        ds = "absent"
    cores = f"{os.cpu_count()} CPU cores"
    if cpu_detail:
        cores = f"{cpu_model()}, {cores} ({usable_cores()} usable)"
    cpu = f"{cores}, {host_memory_bytes() / 2**30:.0f} GiB RAM"
    if gpu and torch.cuda.is_available():
        name = f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
        return f"{name}, {cpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, DeepSpeed {ds}"
    return f"CPU only ({platform.machine()}), {cpu}, torch {torch.__version__}, DeepSpeed {ds}"


def header(title: str, command: str, hardware: str, commit: Optional[str] = None, libraries: Optional[str] = None,
           date: Optional[str] = None) -> list[str]:
    """The top of a results file: what ran, at which commit (`commit`: as read when the run began;
    default: now), where, with what (default: installed here), when (default: now)."""
    return [f"# {title}", "", f"Git commit: {commit or git_commit()}  ", f"Command: `{command}`  ", f"Hardware: {hardware}  ",
            f"Libraries: {libraries or library_versions()}  ", f"Date: {date or utc_now()}", ""]


def fmt(value, spec: str = ".2f", missing: str = "") -> str:
    """A number's table cell; `missing` where it was not measured (None)."""
    return missing if value is None else f"{value:{spec}}"


def mean(values: Iterable) -> Optional[float]:
    """The mean of the measured values (None ignored); None if there are none."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
    """A markdown table's lines: the header, the rule, then a line per row of cells (str() of each)."""
    def line(cells: Sequence) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return [line(columns), "|" + "---|" * len(columns)] + [line(r) for r in rows]


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` in one step: a reader (or a run stopped half-way) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def jsonl_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file another process is appending to, so far (none if it does not
    exist yet; a line still being written is left for the next read)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows
