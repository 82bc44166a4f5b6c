"""The default run reproduces on a busy machine: `launch.threads: auto` takes its count from the
machine, never from its load (issue 46: a fresh clone's `make run` printed another table than README
while other work ran), so an SFT stage trained while other processes keep the cores busy ends with
the same weights, bit for bit, as on an idle machine."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bad_input import run


def weights_digest(root: Path) -> str:
    files = sorted((root / "runs" / "t" / "sft" / "model").glob("*.safetensors"))
    assert files, f"no exported SFT weights under {root}"
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def train_sft(root: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    done = run(root, "stage", "sft", "--restart", "-S", "launch.threads=auto", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: every load gives one thread")
def test_sft_under_load_equals_sft_on_an_idle_machine(project, tmp_path):
    from bad_input import copy_project

    loaded = copy_project(project, tmp_path / "loaded")
    idle_log = train_sft(project)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        loaded_log = train_sft(loaded)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    threads = [line for line in loaded_log.splitlines() if "torch threads:" in line]
    assert threads and "OMP_WAIT_POLICY=PASSIVE" in threads[0], loaded_log[-2000:]  # the load was seen
    assert [line.split("torch threads:")[1].split()[0] for line in idle_log.splitlines() if "torch threads:" in line] == \
        [threads[0].split("torch threads:")[1].split()[0]]
    assert weights_digest(loaded) == weights_digest(project)
