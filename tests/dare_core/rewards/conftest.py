"""A user reward module written for one test: on sys.path, unknown to the reward loader's cache, and
gone from sys.modules afterwards."""
from __future__ import annotations

import sys
import uuid

import pytest

from dare_core.rewards import user


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """write(source) -> the name of a fresh module holding `source`, importable for this test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(user, "_LOADED", {})
    made = []

    def write(source: str) -> str:
        name = f"user_rewards_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(source)
        made.append(name)
        return name

    yield write
    for name in made:
        sys.modules.pop(name, None)
