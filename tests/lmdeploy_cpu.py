"""lmdeploy on CPU, for tests of the engine's code: the overlay `make lmdeploy-cpu` builds.

    from lmdeploy_cpu import lmdeploy_cpu, run_in_lmdeploy  # noqa: F401  (fixture)

    def test_x(lmdeploy_cpu):
        out = run_in_lmdeploy(lmdeploy_cpu, "import sys, lmdeploy; print(sys.argv[1])", "hello")
        assert out.stdout.strip() == "hello"

The overlay is a `pip install --target` folder holding lmdeploy and the few packages it needs beside
DARE's environment (docs/environment.md#lmdeploy); $DARE_LMDEPLOY_CPU names it (`make test` sets
it). lmdeploy is never imported into the pytest process: the overlay and lmdeploy's import-time
side effects stay in a child interpreter, as in DARE, whose RL worker runs the engine in a child
process.

`lmdeploy_cpu` skips when the variable is unset (a developer's bare `pytest`), and fails when it is
set but the overlay is missing or cannot import lmdeploy: CI sets it, so these tests never skip
there unnoticed.
"""
from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lmdeploy.txt"  # the engine environment's lock; the overlay takes its pins
VARIABLE = "DARE_LMDEPLOY_CPU"
BUILD = "make lmdeploy-cpu"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)")


def lock_pins(text: str | None = None) -> dict[str, str]:
    """{normalised name: version} of every `name==version` line of a lock (by default LOCK's)."""
    text = LOCK.read_text() if text is None else text
    return {re.sub(r"[-_.]+", "-", m[1]).lower(): m[2]
            for m in map(PIN.match, text.splitlines()) if m}


def overlay_env(overlay: Path) -> dict:
    """This process's environment with the overlay first on PYTHONPATH, then the checkout (so the
    child imports this checkout's dare_core, not another install's)."""
    env = dict(os.environ)
    paths = [str(overlay), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONFAULTHANDLER"] = "1"  # a child stopped at its time limit prints its Python stacks
    return env


def run_in_lmdeploy(overlay: Path, code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `code` (Python source; `args` are its sys.argv[1:]) in a fresh interpreter like this one
    with the overlay importable. Returns the finished process (text stdout, stderr); a non-zero exit
    or a timeout raises AssertionError with both outputs."""
    argv = [sys.executable, "-c", code, *map(str, args)]
    proc = subprocess.Popen(argv, cwd=REPO, env=overlay_env(Path(overlay)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler dumps every thread's stack, then it dies
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"the lmdeploy child ran past {timeout} s and was stopped\n"
                             f"--- stdout ---\n{out}\n--- stderr ---\n{err}") from None
    if proc.returncode != 0:
        raise AssertionError(f"the lmdeploy child exited with {proc.returncode}\n"
                             f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@functools.lru_cache(maxsize=None)
def checked_overlay(path: str) -> Path:
    """The overlay, once shown to import lmdeploy from itself (cached: every test module that imports
    the fixture gets its own session-scoped copy of it, and the import costs seconds)."""
    overlay = Path(path)
    if not overlay.is_dir():
        pytest.fail(f"${VARIABLE}={path} is not a folder: build it with `{BUILD}` (or unset {VARIABLE} to skip)",
                    pytrace=False)
    try:
        found, broken = run_in_lmdeploy(overlay, "import lmdeploy; print(lmdeploy.__file__)", timeout=180).stdout, None
    except AssertionError as e:
        broken = str(e)
    if broken:
        pytest.fail(f"${VARIABLE}={path} cannot import lmdeploy: rebuild it with `{BUILD}`\n{broken}", pytrace=False)
    found = found.strip().splitlines()[-1]
    if not Path(found).resolve().is_relative_to(overlay.resolve()):
        pytest.fail(f"lmdeploy was imported from {found}, not from ${VARIABLE}={path}: the overlay is not "
                    f"what these tests run against; rebuild it with `{BUILD}`", pytrace=False)
    return overlay


@pytest.fixture(scope="session")
def lmdeploy_cpu() -> Path:
    """The overlay's folder, checked (see the module's docstring for when it skips or fails)."""
    path = os.environ.get(VARIABLE)
    if not path:
        pytest.skip(f"${VARIABLE} is not set: `{BUILD}`, then run pytest with "
                    f"{VARIABLE}={REPO / '.cache' / 'lmdeploy-cpu'} (make test does both)")
    assert "lmdeploy" not in sys.modules, "lmdeploy was imported into the pytest process; use run_in_lmdeploy"
    return checked_overlay(path)
