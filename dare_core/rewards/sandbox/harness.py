"""The modules that each role of a jail loads (`_sandbox_child.load_modules`), as source.

The jail holds the standard library only, so the code of a role travels in its job: the candidate's
side of a test run (`serve`) and the tests' side (`tests`). They are read once per trainer process.
"""
from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent
# (name inside the jail, file): each module may import those before it
_FILES = {
    "serve": [("_harness_serve", "_harness_serve.py")],
    "tests": [("_harness_values", "_harness_values.py"), ("_harness_rewrite", "_harness_rewrite.py"),
              ("pytest", "_pytest_shim.py"), ("_harness_run", "_harness_run.py")],
}
_SOURCES = {role: [[name, (_HERE / file).read_text(encoding="utf-8")] for name, file in files]
            for role, files in _FILES.items()}


def modules_for(role: str) -> list[list[str]]:
    """[[module name, source], ...] for a jail of `role` ("serve" or "tests"); none for the others."""
    return _SOURCES.get(role, [])
