"""The released reference checkpoints' public metadata, kept in tests/reference/checkpoints/<name>/
(config.json, generation_config.json and the gzipped model.safetensors.index.json; no weights), and
the way to their tokenizer files, which stay in ../shared/reference/checkpoints/<name>/.

DARE_SHARED_REFERENCE=<path to a checkpoints folder> moves where the tokenizer files are looked for;
DARE_SHARED_REFERENCE=/nonexistent runs the tests as a clone without ../shared would."""
import gzip
import json
import os
from pathlib import Path

import pytest

CHECKPOINTS = Path(__file__).resolve().parent / "reference" / "checkpoints"
NAMES = ["LLaDA-8B-Instruct", "Dream-v0-Instruct-7B", "SDAR-1dot7B-Chat", "SDAR-4B-Chat", "SDAR-8B-Chat",
         "SDAR-30B-A3B-Chat", "LLaDA2.0-mini", "LLaDA2.1-mini"]
SHARED_ENV = "DARE_SHARED_REFERENCE"
# the sibling folder of this checkout: <parent>/shared/reference/checkpoints
SHARED_DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "reference" / "checkpoints"


def config(name: str) -> dict:
    """The checkpoint's config.json."""
    return json.loads((CHECKPOINTS / name / "config.json").read_text())


def has_index(name: str) -> bool:
    """False for a checkpoint released as one safetensors file (SDAR-1dot7B-Chat): no index."""
    return (CHECKPOINTS / name / "model.safetensors.index.json.gz").exists()


def index(name: str) -> dict:
    """The checkpoint's model.safetensors.index.json (stored gzipped): weight_map and metadata."""
    path = CHECKPOINTS / name / "model.safetensors.index.json.gz"
    if not path.exists():
        raise FileNotFoundError(f"{name} has no model.safetensors.index.json ({path} missing)")
    return json.loads(gzip.decompress(path.read_bytes()))


def shared_root() -> Path:
    return Path(os.environ.get(SHARED_ENV) or SHARED_DEFAULT)


def shared_checkpoint(name: str) -> Path:
    """The checkpoint's folder in ../shared (tokenizer files, chat templates); skips the test when absent."""
    folder = shared_root() / name
    if not folder.is_dir():
        pytest.skip(f"tokenizer files of {name} not present: {folder} missing "
                    f"(../shared/reference/checkpoints, or set {SHARED_ENV})")
    return folder
