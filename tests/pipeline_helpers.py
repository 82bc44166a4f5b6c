"""Tiny self-contained pipeline configs for stage and end-to-end tests."""
from __future__ import annotations

import copy
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) and k not in ("init", "task_args") else v
    return out


TINY = {
    "run": {"name": "t", "seed": 0},
    "data": {"task_args": {"min_digits": 1, "max_digits": 2, "ops": "+", "zero_pad": True, "demo_error_rate": 0.5},
             "num_sft": 400, "num_rl": 64, "num_eval": 40, "num_preference": 64, "num_val": 16, "seed": 1},
    "model": {"init": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden_size": 64, "max_sequence_length": 24}},
    "sft": {"max_steps": 20, "micro_batch_size": 16, "pad_to": 4, "log_every": 5, "save_every": 10, "optim": {"lr": 3.0e-3}},
    "rl": {"num_steps": 3, "prompts_per_step": 4, "group_size": 4, "num_iterations": 2, "save_every": 2,
           "sampler": {"gen_length": 4, "steps": 4, "block_length": 4, "temperature": 1.0, "batch_size": 16}},
    "preference": {"max_steps": 4, "micro_batch_size": 4, "pad_to": 4, "log_every": 2, "save_every": 2},
    "eval": {"sampler": {"gen_length": 4, "steps": 4, "block_length": 4, "batch_size": 20}},
    # one torch thread per rank: on models this small a second one only spin-waits (an RL stage here
    # took 19-21 s on two threads, 11 s on one); `auto` is what params.yaml and tests/dare_core/test_threads.py run
    "launch": {"threads": 1},
}


def tiny_params(root: Path, **overrides) -> dict:
    """The repository's params.yaml (every key DVC tracks) shrunk to a seconds-long run under `root`."""
    # a deep copy: `init` and `task_args` come from TINY whole, and a test that edits its params
    # would otherwise edit TINY for every later test in the process
    params = copy.deepcopy(_merge(yaml.safe_load((REPO / "params.yaml").read_text()), TINY))
    params["run"].update(runs_dir=str(root / "runs"), models_dir=str(root / "models"), metrics_dir=str(root / "metrics"))
    params["data"].update(prepared_dir=str(root / "data" / "prepared"), tokenizer_dir=str(root / "data" / "tokenizer"))
    for dotted, value in overrides.items():
        node = params
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return params


def write_params(path: Path, params: dict) -> Path:
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def worker_env(venv_on_path: bool = True) -> dict:
    """The environment of a `dare` subprocess; `venv_on_path=False`: as for a user who runs
    `.venv/bin/dare` without activating the venv (nothing may be looked up on PATH)."""
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    others = [d for d in env.get("PATH", "").split(os.pathsep) if d and Path(d) != Path(venv_bin)]
    env["PATH"] = os.pathsep.join([venv_bin, *others] if venv_on_path else others)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def two_cpu_ranks(script: str, out_dir: Path, timeout: float, **env_vars: str) -> None:
    """`tests/<script> <out_dir>` as two gloo ranks on the CPU (torchrun, one thread each, the tests
    folder importable); fails with the ranks' stderr unless both succeed."""
    env = {**worker_env(), "OMP_NUM_THREADS": "1", **env_vars}
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{REPO / 'tests'}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / script), str(out_dir)]
    r = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-6000:]


def end_gloo_rank() -> None:
    """How a rank script of `two_cpu_ranks` ends: as a stage worker's rank does (workers/common.py),
    the group left after a barrier and the interpreter's teardown skipped. A plain exit let gloo's
    worker threads meet the finalizing interpreter: SIGABRT ("terminate called without an active
    exception") after the rank had written its results, about once in a few dozen CI runs."""
    from dare_core.process.process_group import exit_before_teardown, shutdown_distributed

    shutdown_distributed(clean=True)
    exit_before_teardown(0)


# what torch's C++ side prints when ranks end untidily (or would, unfiltered: workers/rank_output.py)
NATIVE_NOISE = re.compile(r"TCPStore|destroy_process_group|frame #\d|Exception raised from|terminate called"
                          r"|\[[EWIF]\d{4} \d\d:|Guessing device ID")


def assert_no_native_noise(stderr: str) -> None:
    """A successful multi-rank run's stderr holds no C++ warnings or traces."""
    found = NATIVE_NOISE.search(stderr)
    assert not found, stderr[max(0, found.start() - 1500):found.start() + 1500]


def dare(*args: str) -> list[str]:
    return [sys.executable, "-m", "dare_core.cli", *args]


def sort_rows(n: int, seed: int) -> list[dict]:
    """A user's task: sort the digits ("sort 3 1 2" -> "1 2 3"), graded by exact_match."""
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(2, 4))]
        if " ".join(digits) in seen:
            continue
        seen.add(" ".join(digits))
        answer = " ".join(sorted(digits))
        rows.append({"prompt": "sort " + " ".join(digits), "response": answer, "ground_truth": answer})
    return rows


# the pipeline a project copies: dvc.yaml, and the input-file list it reads (`vars`)
PIPELINE_FILES = ("dvc.yaml", "data/input_files.yaml")


def copy_pipeline(repo: Path) -> None:
    for name in PIPELINE_FILES:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text((REPO / name).read_text())


def make_project(repo: Path, params: dict, links: tuple = ("dare_core", "configs"), env: dict | None = None) -> Path:
    """A throwaway DARE project at `repo`: the real dvc.yaml, `links` symlinked from this checkout
    (dvc.yaml's code dependencies and recipes; add flows/tasks to deploy it), `params` with its
    outputs at the project's own relative paths, `git init` and `dvc init`."""
    repo.mkdir()
    copy_pipeline(repo)
    for name in links:
        os.symlink(REPO / name, repo / name)
    params["run"].update(runs_dir="runs", models_dir="models", metrics_dir="metrics")
    params["data"].update(prepared_dir="data/prepared", tokenizer_dir="data/tokenizer")
    write_params(repo / "params.yaml", params)
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env, capture_output=True)
    return repo
