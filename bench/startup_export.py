"""How fast a stage gets its model and hands it back: load, from-scratch init, LoRA-merged export.

    .venv/bin/python bench/startup_export.py                                # CPU, LLaDA-8B shape with 2 layers
    python3 bench/startup_export.py --device cuda --layers 32               # the real LLaDA-8B size, on a GPU

A model of `--config` (a real config.json from bench/configs, `--layers` of them) is initialised from
scratch in bf16 on the device (timed: what an SFT stage without `model.path` does) and written in the
real on-disk layout (safetensors shards + index). Then, each timed on its own:

  - the raw read speed of those shard files (plain sequential reads, nothing else: the disk's pace),
  - `load_model` of the folder onto the device in bf16 (what every stage with a checkpoint does),
  - LoRA applied (rank 32, all linear layers) and the merged model exported (what SFT does at its end),
  - `verify_saved` of that export (what the convert stage adds).

Read and load run twice: "cold" after the shard files were flushed and dropped from the page cache
(posix_fadvise DONTNEED: the disk itself, as far as the machine lets a process ask) and "warm" with
them cached. Peak host RSS is the process's high-water mark during the phase (mapped shard pages
count in it); peak GPU memory is torch's. The results go to bench/results/startup_export.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dare_core.diffusion.seeding import generator  # noqa: E402
from dare_core.models.lora import LoraSettings, apply_lora, lora_layers  # noqa: E402
from dare_core.models.lm import empty_model  # noqa: E402
from dare_core.models.hf_folder import load_model, save_model, verify_saved  # noqa: E402
from stamp import fmt, git_commit, hardware, library_versions, markdown_table  # noqa: E402

CONFIGS = REPO / "bench" / "configs"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peaks(device: torch.device) -> None:
    try:  # Linux: "5" resets this process's peak RSS (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def timed(label: str, device: torch.device, fn, nbytes: int, rows: list[dict]):
    gc.collect()
    os.sync()  # the last phase's dirty pages written back first: each write starts from a clean slate
    _reset_peaks(device)
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    seconds = time.perf_counter() - t0
    row = {"phase": label, "s": seconds, "GB/s": nbytes / seconds / 1e9, "rss": _peak_rss_gb(),
           "gpu": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None}
    rows.append(row)
    print(f"{label:<42} {seconds:8.2f} s  {row['GB/s']:6.2f} GB/s  peak RSS {row['rss']:.1f} GB", flush=True)
    return out


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def drop_from_cache(folder: Path) -> None:
    """Write back and forget the folder's pages, so that the next read comes from the disk."""
    for path in shard_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(folder: Path) -> int:
    """Read every shard once, sequentially, in 64 MiB chunks into one reused buffer."""
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total = 0
    for path in shard_files(folder):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def write_file(path: Path, nbytes: int) -> int:
    """Write `nbytes` to one file in 64 MiB chunks from one reused buffer: the disk's (or page
    cache's) write pace, which an export can at best match (neither fsyncs)."""
    view = memoryview(bytearray(64 << 20))
    done = 0
    with open(path, "wb") as f:
        while done < nbytes:
            done += f.write(view[: min(len(view), nbytes - done)])
    return done


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in shard_files(folder))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="LLaDA-8B-Instruct", help="a config.json in bench/configs (name) or a path")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (the real config's count: 32 for LLaDA-8B)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--workdir", default=None, help="where the model folders are written and kept (default: a temporary folder, removed)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "startup_export.md"))
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config_path = Path(args.config) if Path(args.config).is_file() else CONFIGS / f"{args.config}.json"
    cfg = json.loads(config_path.read_text())
    layer_key = next(k for k in ("n_layers", "num_hidden_layers") if k in cfg)
    cfg[layer_key] = args.layers
    cfg.setdefault("mask_token_id", 1)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="startup_export-"))
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows: list[dict] = []
    try:
        facts = run_phases(cfg, device, work, args.lora_rank, rows)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    write_report(args, argv, device, config_path, facts, rows, started)
    return 0


def run_phases(cfg: dict, device: torch.device, work: Path, lora_rank: int, rows: list[dict]) -> dict:
    """Every timed phase, in the order a pipeline meets them; returns the model's sizes."""
    base, merged = work / "base", work / "merged"

    def init():
        model = empty_model(cfg, device=device, dtype=torch.bfloat16)
        model.net.init_weights(generator(0, "init", device=device))
        return model

    warmup = init()  # untimed: the first CUDA / allocator use is not what a stage pays per model
    nbytes = sum(t.numel() * t.element_size() for t in warmup.state_dict().values())
    n_params = sum(p.numel() for p in warmup.parameters())
    warmup = None
    scratch = timed("from-scratch init (bf16, on the device)", device, init, nbytes, rows)
    timed("write a file of that size (plain writes)", device, lambda: write_file(work / "raw.bin", nbytes), nbytes, rows)
    (work / "raw.bin").unlink()
    timed("export (save_model, no LoRA)", device, lambda: save_model(scratch, base), nbytes, rows)
    scratch = None  # freed before the loads
    size = folder_bytes(base)

    def load():
        return load_model(base, dtype=torch.bfloat16, device=device)

    drop_from_cache(base)
    timed("read the shard files (cold)", device, lambda: read_files(base), size, rows)
    drop_from_cache(base)
    timed(f"load_model to {device.type} (cold)", device, load, size, rows)  # the model is dropped at once
    timed("read the shard files (warm)", device, lambda: read_files(base), size, rows)
    model = timed(f"load_model to {device.type} (warm)", device, load, size, rows)

    def lora():
        apply_lora(model, LoraSettings(r=lora_rank, alpha=16))
        for i, layer in enumerate(lora_layers(model.net)):  # a trained adapter: B != 0
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.01, generator=generator(i, "b", device=device))

    timed("import peft (once per process)", device, lambda: importlib.import_module("peft"), 0, rows)
    timed(f"apply LoRA (r={lora_rank}, all-linear)", device, lora, 0, rows)
    timed("export (save_model, LoRA merged)", device, lambda: save_model(model, merged), nbytes, rows)
    timed("verify_saved of that export", device, lambda: verify_saved(model, merged), nbytes, rows)
    return {"params": n_params, "bytes": size, "shards": len(shard_files(base))}


def write_report(args, argv, device: torch.device, config_path: Path, facts: dict, rows: list[dict], started) -> None:
    command = "python3 bench/startup_export.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Stage start-up and export: load, from-scratch init, LoRA-merged export",
        "",
        f"Commit: {git_commit()}  ", f"Libraries: {library_versions()}  ",
        f"Command: `{command.strip()}`  ",
        f"Hardware: {hardware(gpu=device.type == 'cuda', cpu_detail=True)}  ",
        f"Date: {started:%Y-%m-%d %H:%M} UTC  ",
        f"Model: {config_path.name} with {args.layers} layers: {facts['params'] / 1e9:.2f} B parameters, "
        f"{facts['bytes'] / 1e9:.2f} GB in bf16 ({facts['shards']} shard{'s' if facts['shards'] > 1 else ''})",
        "",
    ]
    gpu = device.type == "cuda"
    lines += markdown_table(["phase", "seconds", "GB/s", "peak host RSS (GB)"] + (["peak GPU memory (GB)"] if gpu else []), [
        [r["phase"], f"{r['s']:.2f}", f"{r['GB/s']:.2f}" if r["GB/s"] else "", f"{r['rss']:.1f}"] + ([fmt(r["gpu"], ".1f")] if gpu else [])
        for r in rows])
    lines += [
        "",
        "GB/s: the model's (or the files') bytes over the phase's time. \"write a file\" and \"read the shard "
        "files\" are the disk's pace with nothing else done (writes land in the page cache, as an export's do; "
        "reads come from the disk when cold, from the page cache when warm): an export or a load close to them "
        "runs at disk speed. "
        "Every phase starts after `sync` (no earlier write still pending). "
        "Cold: the shards flushed and dropped from the page cache first (posix_fadvise), which a virtual "
        "machine's host may still cache. Peak host RSS counts the shard pages mapped while they are read.",
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
