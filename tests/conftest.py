"""Shared fixtures: tiny models of a real family built in memory, one intra-op thread, and GPU-test skipping."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The longest test modules, longest first (seconds on 2 shared cores, from a run's --durations).
# `make test` spreads whole modules over two workers in collection order (pytest-xdist's
# loadfile): started first, the long ones run beside the many short ones instead of leaving one
# worker alone with them at the end. A stale list only costs balance, never a result.
LONGEST_FIRST = [
    "tests/flows/test_embedded_learning.py",  # 550
    "tests/flows/test_deployments.py",  # 230
    "tests/flows/test_own_data_doc.py",  # 185
    "tests/dare_core/training/test_preference_stage.py",  # 185
    "tests/dare_core/training/test_ranks_match.py",  # 180
    "tests/dare_core/test_bad_input_stages.py",  # 175
    "tests/flows/test_pipeline.py",  # 105
    "tests/dare_core/training/test_ranks_faults.py",  # 90
    "tests/flows/test_object_storage.py",  # 85
    "tests/dare_core/eval/test_opencompass.py",  # 85
    "tests/dare_core/models/test_compile.py",  # 80
    "tests/flows/test_embedded_pipeline.py",  # 75
    "tests/flows/test_ui_screenshot.py",  # 75
    "tests/dare_core/test_bad_input_commands.py",  # 75
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath
    # stable: the tests of one module keep their order and stay together (module-scoped fixtures)
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_tiny_llada(vocab_size: int = 40, mask_id: int = 39, eos_id: int = 38, seed: int = 0, **sizes):
    from dare_core.diffusion.seeding import generator
    from dare_core.models.llada import tiny_config
    from dare_core.models.lm import build_model

    sizes = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "mlp_hidden_size": 64, "max_sequence_length": 64, **sizes}
    model = build_model(tiny_config(vocab_size, mask_id, eos_id, **sizes))
    model.net.init_weights(generator(seed, "test-init"), std=0.2)
    return model.eval()


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Every test computes in this process on one intra-op thread (restored afterwards). The models
    here are tiny: threads only add synchronisation, and on a machine shared with other jobs their
    spin-waiting made decoding tests up to 30 times slower (tests/dare_core/sampling/test_cache.py:
    0.8 s on one thread, 24 s on two). Stages run as subprocesses choose their own threads (launch.threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_llada():
    return make_tiny_llada()


@pytest.fixture(scope="session")
def built_project(tmp_path_factory):
    """A tiny project after prepare, sft, preference, rl and convert (tests/bad_input.py); built once."""
    from bad_input import build_project

    root = tmp_path_factory.mktemp("built_project")
    build_project(root)
    return root


@pytest.fixture
def project(built_project, tmp_path):
    """A fresh copy of `built_project` for one bad-input case."""
    from bad_input import copy_project

    return copy_project(built_project, tmp_path / "project")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """write(source) -> the name of a fresh module holding `source`, importable for this test, unknown to
    the reward loader's cache and gone from sys.modules afterwards (a user reward module)."""
    import sys
    import uuid

    from dare_core.rewards import user

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
