"""The bad-input corpus: a populated project built once, and the check every bad input must pass.

Every case runs a real command (`dare ...` in a subprocess, cwd = the project) on a fresh copy of a
project that already holds prepared data, SFT/preference/RL checkpoints, exported models and
metrics, and then asserts (`assert_clean_failure`):
- the exit code is not 0;
- stderr is exactly one non-empty line, `error: ...`, naming the culprit (file, row, key or
  parameter), and no traceback;
- every file under runs/, models/, metrics/ and data/ is byte-identical to before, and no file or
  folder was added there.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Union

from pipeline_helpers import dare, tiny_params, worker_env, write_params

WATCHED = ("runs", "models", "metrics", "data")


def build_project(root: Path) -> Path:
    """A tiny project that has run prepare, sft, preference, rl and convert (relative paths, so a
    copy of the folder is a project of its own). Returns the params file."""
    root.mkdir(parents=True, exist_ok=True)
    params = tiny_params(root)
    params["run"].update(runs_dir="runs", models_dir="models", metrics_dir="metrics")
    params["data"].update(prepared_dir="data/prepared", tokenizer_dir="data/tokenizer")
    path = write_params(root / "params.yaml", params)
    for stage in ("prepare", "sft", "preference", "rl", "convert"):
        done = run(root, "stage", stage)
        if done.returncode != 0:
            raise RuntimeError(f"building the bad-input project: stage {stage} failed:\n{done.stderr[-3000:]}")
    return path


def copy_project(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest, symlinks=True)
    return dest


def run(root: Path, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`dare <args>` with the project as working directory."""
    return subprocess.run(dare(*args), cwd=root, env={**worker_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file (and '<dir>' for every folder) under the watched roots."""
    state: dict[str, str] = {}
    for top in WATCHED:
        base = root / top
        if not base.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, root)
            state[rel] = "<dir>"
            for name in filenames:
                path = os.path.join(dirpath, name)
                if os.path.islink(path):
                    state[os.path.relpath(path, root)] = "-> " + os.readlink(path)
                    continue
                with open(path, "rb") as f:
                    state[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return state


def assert_clean_failure(result: subprocess.CompletedProcess, culprit: Union[str, Iterable[str]],
                         before: dict[str, str], root: Path) -> str:
    """The checks of the module docstring; `culprit`: text(s) the error line must contain. Returns the line."""
    stderr = result.stderr
    assert result.returncode != 0, f"exit code 0 for bad input; stderr:\n{stderr[-2000:]}"
    assert "Traceback" not in stderr, f"a traceback instead of one line:\n{stderr[-3000:]}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr[-3000:]}"
    line = lines[0]
    assert line.startswith("error: "), line
    for text in [culprit] if isinstance(culprit, str) else culprit:
        assert text in line, f"the error does not name {text!r}: {line}"
    after = snapshot(root)
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    removed = sorted(k for k in before if k not in after)
    added = sorted(k for k in after if k not in before)
    assert not (changed or removed or added), f"files touched: changed {changed[:5]}, removed {removed[:5]}, added {added[:5]}"
    return line
