"""The lmdeploy engine's own environment resolves, and its lock is what that resolution gives
(requirements/lmdeploy.in -> requirements/lmdeploy.txt by `make lmdeploy-lock`; docs/environment.md#lmdeploy).

uv resolves from PyPI's metadata alone (no wheel is downloaded): ~12 s cold, a few seconds once its
cache holds the metadata. CI reaches PyPI, so a resolve that fails is a failure, never a skip.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from lmdeploy_cpu import LOCK, REPO, lock_pins

SOURCE = REPO / "requirements" / "lmdeploy.in"
DARE_LOCK = REPO / "requirements" / "lock.txt"
MAKEFILE = REPO / "Makefile"
# The pins that decide whether the engine works for DARE: the engine, its torch and triton (kernels),
# transformers (reads the model folder DARE hands over), peft (why the environment is a second one).
DECISIVE = ("lmdeploy", "torch", "transformers", "peft", "triton")
PYTHONS = ("3.11", "3.12")  # the GPU machines' Pythons; the lock is resolved for the first
# lmdeploy 0.18.0's Requires-Dist upper bounds (peft<=0.14.0 is in every release) that DARE passes
LMDEPLOY_MAX = {"peft": Version("0.14.0"), "torch": Version("2.12.1")}


def uv() -> str:
    beside = Path(sys.executable).with_name("uv")
    found = str(beside) if beside.exists() else shutil.which("uv")
    assert found, "uv is missing: it comes with requirements/test.txt (make venv-test)"
    return found


def uv_args(python: str | None = None) -> list[str]:
    """The Makefile's LMDEPLOY_UV_ARGS (index, platform, Python), with `python` as the target version."""
    m = re.search(r"^LMDEPLOY_UV_ARGS\s*:=\s*(.+)$", MAKEFILE.read_text(), re.M)
    assert m, "the Makefile no longer defines LMDEPLOY_UV_ARGS"
    args = m[1].split()
    if python:
        args[args.index("--python-version") + 1] = python
    return args


def resolve(requirements: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`uv pip compile` of `requirements`, the result on stdout. UV_* variables are dropped: one such
    as UV_EXCLUDE_NEWER or UV_INDEX would change the answer on one machine only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    return subprocess.run([uv(), "pip", "compile", *args, "--no-header", str(requirements)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def resolved_pins(requirements: Path, args: list[str]) -> dict[str, str]:
    proc = resolve(requirements, args)
    assert proc.returncode == 0, f"uv could not resolve {requirements.name} with {' '.join(args)}:\n{proc.stderr}"
    return lock_pins(proc.stdout)


def dare_torch() -> Version:
    """DARE's torch: the Makefile's TORCH_SPEC (lock.txt leaves torch out: its build is per machine)."""
    specs = re.findall(r"^TORCH_SPEC \?= torch==(\S+)", MAKEFILE.read_text(), re.M)
    assert specs, "the Makefile no longer pins torch in TORCH_SPEC"
    versions = {Version(s).public for s in specs}  # 2.13.0 and 2.13.0+cpu are one release
    assert len(versions) == 1, f"the Makefile's CPU and CUDA torch pins differ: {specs}"
    return Version(versions.pop())


def test_lock_header_holds_the_makefile_command():
    command = f"#   uv pip compile {' '.join(uv_args())} --no-header requirements/lmdeploy.in -o requirements/lmdeploy.txt"
    assert command in LOCK.read_text().splitlines()[:5], \
        "requirements/lmdeploy.txt was not made with the Makefile's LMDEPLOY_UV_ARGS: run make lmdeploy-lock"


def test_source_resolves_to_the_locks_decisive_pins():
    got, locked = resolved_pins(SOURCE, uv_args()), lock_pins()
    want = {name: locked.get(name) for name in DECISIVE}
    assert None not in want.values(), f"requirements/lmdeploy.txt lacks one of {DECISIVE}: {want}"
    assert {name: got.get(name) for name in DECISIVE} == want, \
        "requirements/lmdeploy.in now resolves otherwise than the lock: run make lmdeploy-lock"


@pytest.mark.parametrize("python", PYTHONS)
def test_lock_is_complete_and_consistent(python):
    """All `==` and nothing missing: resolving the lock itself gives the lock back, for each Python.
    `make lmdeploy` installs it with --no-deps, so a dependency left out would be missing, not fetched."""
    got, locked = resolved_pins(LOCK, uv_args(python)), lock_pins()
    added = {n: v for n, v in got.items() if n not in locked}
    changed = {n: (locked[n], got.get(n)) for n in locked if got.get(n) != locked[n]}
    assert not added and not changed, f"Python {python}: the lock lacks {added}; lock vs resolved differ on {changed}"


def test_engine_and_dare_share_transformers():
    engine, dare = lock_pins()["transformers"], lock_pins(DARE_LOCK.read_text())["transformers"]
    assert engine == dare, (f"the engine's transformers {engine} and DARE's {dare} differ: set "
                            f"requirements/lmdeploy.in to {dare}, then make lmdeploy-lock")


@pytest.mark.parametrize("name", sorted(LMDEPLOY_MAX))
def test_one_environment_is_impossible(name, tmp_path):
    """The engine's lock keeps lmdeploy's bounds and DARE keeps its newer peft and torch; lmdeploy
    beside DARE's pin does not resolve. Were it to, the second environment would have no reason."""
    engine = Version(lock_pins()[name])
    dare = Version(lock_pins(DARE_LOCK.read_text())["peft"]) if name == "peft" else dare_torch()
    bound = LMDEPLOY_MAX[name]
    assert engine <= bound < dare, f"{name}: engine lock {engine}, lmdeploy's bound {bound}, DARE {dare}"
    together = tmp_path / "together.in"
    together.write_text(f"lmdeploy=={lock_pins()['lmdeploy']}\n{name}=={dare}\n")
    proc = resolve(together, uv_args())
    assert proc.returncode != 0, f"lmdeploy and DARE's {name} {dare} now resolve together:\n{proc.stdout}"
    assert name in proc.stderr, f"the resolve failed, but not on {name}:\n{proc.stderr}"
