"""Remote inputs (s3:// data files and model folders) against a real S3 endpoint (moto's server on
127.0.0.1): read through a verified download cache that is reused while the objects are unchanged,
refreshed when they change or the cached copy was tampered with; clear errors that name the URL
and never a credential; local-only outputs refuse URLs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
import torch

from dare_core import remote
from dare_core.config import ConfigError, DareConfig, load_config
from dare_core.inputs import model_folder
from dare_core.data.prepare import prepare
from dare_core.data.schema import DataError
from dare_core.diffusion.seeding import generator
from dare_core.models.hf_folder import load_model, save_model
from dare_core.object_cache import local_copy
from dare_core.remote import RemoteError
from dare_core.training.setup import initial_model
from dare_core.process.workspaces import WORKSPACES, prune
from git_repos import committed_repo, git
from pipeline_helpers import worker_env
from s3_server import ACCESS_KEY, SECRET, s3_bucket, s3_server, start_moto  # noqa: F401  (fixtures)
from tiny_models import tiny


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def s3():
    return fsspec.filesystem("s3", skip_instance_cache=True)


def rows(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1), "ground_truth": str(i + 1)}) + "\n"
                   for i in range(start, start + n))


def data_cfg(root: Path, source: str, eval_source: str) -> DareConfig:
    cfg = DareConfig()
    cfg.data.prepared_dir, cfg.data.tokenizer_dir = str(root / "prepared"), str(root / "tokenizer")
    cfg.data.source, cfg.data.eval_source = source, eval_source
    cfg.data.num_sft, cfg.data.num_rl, cfg.data.num_eval, cfg.data.num_val = 20, 10, 0, 5
    return cfg


def test_s3_data_files_prepare_like_the_local_files(tmp_path, s3_bucket, s3_server):
    local = tmp_path / "local"
    local.mkdir()
    (local / "raw.jsonl").write_text(rows(40))
    (local / "test.jsonl").write_text(rows(8, start=100))
    s3().put(str(local / "raw.jsonl"), f"{s3_bucket}/in/raw.jsonl")
    s3().put(str(local / "test.jsonl"), f"{s3_bucket}/in/test.jsonl")
    a = data_cfg(tmp_path / "a", str(local / "raw.jsonl"), str(local / "test.jsonl"))
    b = data_cfg(tmp_path / "b", f"s3://{s3_bucket}/in/raw.jsonl", f"s3://{s3_bucket}/in/test.jsonl")
    summary_a, summary_b = prepare(a), prepare(b)
    for split in ("sft", "rl", "eval", "val", "preference"):
        assert pq.read_table(tmp_path / "a" / "prepared" / f"{split}.parquet").to_pylist() == \
            pq.read_table(tmp_path / "b" / "prepared" / f"{split}.parquet").to_pylist(), split
    # the URL, as configured, where the summary names the origin
    assert summary_b["source"] == f"s3://{s3_bucket}/in/raw.jsonl"
    assert summary_b["preference"]["origin"] == f"derived from s3://{s3_bucket}/in/raw.jsonl"
    # made_from: the digest of the settings and inputs the data was made from (their places included)
    same = [k for k in summary_a if "source" not in k and k not in ("preference", "made_from")]
    assert {k: summary_a[k] for k in same} == {k: summary_b[k] for k in same}
    assert not any("s3:" in p.name for p in tmp_path.rglob("*"))  # no folder named after the URL


def test_missing_and_malformed_remote_data_name_the_url(tmp_path, s3_bucket):
    with pytest.raises(DataError, match=rf"^data file not found: s3://{s3_bucket}/nope.jsonl$"):
        prepare(data_cfg(tmp_path, f"s3://{s3_bucket}/nope.jsonl", None))
    s3().pipe(f"{s3_bucket}/bad.jsonl", rows(3).encode() + b"not json\n")
    with pytest.raises(DataError, match=rf"^s3://{s3_bucket}/bad.jsonl: line 4: not valid JSON"):
        prepare(data_cfg(tmp_path, f"s3://{s3_bucket}/bad.jsonl", None))
    assert not (tmp_path / "prepared").exists()


def _upload_model(bucket: str, folder: Path, key: str = "models/tiny") -> str:
    s3().put(str(folder), f"{bucket}/{key}", recursive=True)
    return f"s3://{bucket}/{key}"


def test_s3_model_folder_loads_the_same_weights_and_is_cached(tmp_path, s3_bucket, s3_server, cache):
    folder = save_model(tiny("llada"), tmp_path / "tiny", max_shard_bytes=20_000)  # several shards
    url = _upload_model(s3_bucket, folder)
    cfg = DareConfig()
    cfg.model.path = url
    x = torch.randint(0, 60, (2, 12), generator=generator(9, "remote"))
    with torch.no_grad():
        want = load_model(folder)(x)
        got = initial_model(cfg, tokenizer=None).eval()(x)
    assert torch.equal(got, want)  # bit for bit
    copy = model_folder(cfg)
    assert copy == cache / "s3" / s3_bucket / "models" / "tiny" and copy == cfg.checkpoint_dirs["base"]
    names = sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in copy.iterdir()) == names and len(names) > 3

    # reused: no object is fetched again while nothing changed
    fetched = len(s3_server.requests("GET", f"/{s3_bucket}/models/tiny/"))
    assert fetched == len(names)
    inodes = {n: (copy / n).stat().st_ino for n in names}
    assert model_folder(cfg) == copy
    assert len(s3_server.requests("GET", f"/{s3_bucket}/models/tiny/")) == fetched

    # one object changed remotely: only it is fetched; the others are kept (hard links, same inodes)
    changed = json.loads((folder / "config.json").read_text())
    changed["dare_note"] = "v2"
    s3().pipe(f"{s3_bucket}/models/tiny/config.json", json.dumps(changed).encode())
    assert json.loads((model_folder(cfg) / "config.json").read_text())["dare_note"] == "v2"
    assert len(s3_server.requests("GET", f"/{s3_bucket}/models/tiny/")) == fetched + 1
    assert all((copy / n).stat().st_ino == inodes[n] for n in names if n != "config.json")

    # a cached file damaged in place (same size) is noticed and fetched again
    shard = next(n for n in names if n.endswith(".safetensors"))
    data = bytearray((copy / shard).read_bytes())
    data[-1] ^= 0xFF
    (copy / shard).write_bytes(bytes(data))
    assert (model_folder(cfg) / shard).read_bytes() == (folder / shard).read_bytes()
    assert len(s3_server.requests("GET", f"/{s3_bucket}/models/tiny/")) == fetched + 2
    # a file added to the cached copy is removed: the copy is exactly the prefix
    (copy / "stray.txt").write_text("x")
    assert not (model_folder(cfg) / "stray.txt").exists()


def test_a_download_that_fails_verification_is_not_kept(tmp_path, s3_bucket, cache, monkeypatch):
    s3().pipe(f"{s3_bucket}/d/raw.jsonl", rows(5).encode())
    monkeypatch.setattr(remote, "_expected_md5", lambda info: "0" * 32)  # as if the bytes were corrupted in transit
    with pytest.raises(RemoteError, match=rf"s3://{s3_bucket}/d/raw.jsonl: the download's MD5 .* differs"):
        local_copy(f"s3://{s3_bucket}/d/raw.jsonl")
    assert not [p for p in cache.rglob("*") if p.is_file() and ".locks" not in p.parts]
    monkeypatch.setenv(remote.VERIFY_ENV, "size")  # SSE-KMS buckets: ETags are not MD5s
    assert local_copy(f"s3://{s3_bucket}/d/raw.jsonl").read_text() == rows(5)


def test_model_folder_errors_name_the_url_and_no_secret(tmp_path, s3_bucket, monkeypatch):
    cfg = DareConfig()
    cfg.model.path = f"s3://{s3_bucket}/models/absent"
    with pytest.raises(RemoteError, match=rf"^model folder not found: s3://{s3_bucket}/models/absent"):
        model_folder(cfg)
    s3().pipe(f"{s3_bucket}/models/one.bin", b"x")
    cfg.model.path = f"s3://{s3_bucket}/models/one.bin"
    with pytest.raises(RemoteError, match="is a single object, not a folder"):
        model_folder(cfg)

    # a server that knows no key: access denied, naming the URL and the variables to check
    endpoint, stop = start_moto(auth=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        with pytest.raises(RemoteError) as denied:
            local_copy(f"s3://{s3_bucket}/models/one.bin")
    finally:
        stop()
    message = str(denied.value)
    assert message.startswith(f"s3://{s3_bucket}/models/one.bin: access denied") and "AWS_SECRET_ACCESS_KEY" in message
    assert SECRET not in message and ACCESS_KEY not in message

    # nothing listens there: a connection error, one quick try (AWS_MAX_ATTEMPTS)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(RemoteError, match=r"listing it failed \(EndpointConnectionError.*AWS_ENDPOINT_URL_S3"):
        local_copy(f"s3://{s3_bucket}/models/one.bin")


@pytest.mark.parametrize("key", ["run.runs_dir", "run.models_dir", "run.metrics_dir", "data.prepared_dir",
                                 "data.tokenizer_dir"])
def test_dvc_outputs_refuse_urls(key):
    params = Path(__file__).resolve().parents[2] / "params.yaml"
    with pytest.raises(ConfigError, match=rf"key '{key}' is a DVC output and must be a local path, got 's3://bkt/x'; "
                                          r"set run.artifact_root: s3://\.\.\. to copy run artifacts"):
        load_config(params, [f"{key}=s3://bkt/x"])


def test_stage_with_a_url_output_fails_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from dare_core.cli import main

    monkeypatch.chdir(tmp_path)
    params = Path(__file__).resolve().parents[2] / "params.yaml"
    assert main(["stage", "prepare", "--params", str(params), "-S", "data.prepared_dir=s3://bucket/prepared"]) == 2
    assert "data.prepared_dir' is a DVC output and must be a local path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_isolated_runs_share_one_download_that_pruning_keeps(tmp_path, s3_bucket, s3_server, monkeypatch):
    """Each isolated run works in its own workspace (`<checkout>/.cache/workspaces/<name>`, the
    stages' working directory); the inputs they fetch go to the checkout's cache, once."""
    monkeypatch.delenv(remote.CACHE_ENV)  # the project's own cache, as a run has it
    repo = committed_repo(tmp_path / "project", {"params.yaml": "a: 1\n"})
    spaces = [repo / WORKSPACES / f"run-{i}" for i in range(2)]
    for space in spaces:
        git(repo, "worktree", "add", "-q", "--detach", str(space))
    url, gets = f"s3://{s3_bucket}/in/raw.jsonl", lambda: len(s3_server.requests("GET", f"/{s3_bucket}/in/raw.jsonl"))
    s3().pipe(f"{s3_bucket}/in/raw.jsonl", rows(2000).encode())  # ~150 kB: the two fetches overlap
    # two runs at once, one in each workspace: one download, which both read
    code = "import sys; from dare_core.object_cache import local_copy; print(local_copy(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], cwd=space, env=worker_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for space in spaces]
    outs = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
    cached = repo / ".cache" / "remote" / "s3" / s3_bucket / "in" / "raw.jsonl"
    assert [Path(out.strip()) for out, _ in outs] == [cached, cached] and cached.read_text() == rows(2000)
    assert gets() == 1
    # content-addressed: the same bytes under another URL are not fetched again
    s3().copy(f"{s3_bucket}/in/raw.jsonl", f"{s3_bucket}/elsewhere/same.jsonl")
    monkeypatch.chdir(spaces[0])
    assert local_copy(f"s3://{s3_bucket}/elsewhere/same.jsonl").read_text() == rows(2000)
    assert not s3_server.requests("GET", f"/{s3_bucket}/elsewhere/")

    # pruning removes the workspaces, not the cache: the next run reads the same copy
    monkeypatch.chdir(repo)
    assert prune(repo, keep=0, failed_for_h=0, say=lambda _: None) == 2 and not any(s.exists() for s in spaces)
    assert local_copy(url) == cached and gets() == 1
    # a changed object (another ETag and size) is fetched again, and its old bytes are deleted
    objects = {p for p in (repo / ".cache" / "remote" / "objects").rglob("*") if p.is_file() and p.suffix != ".json"}
    s3().pipe(f"{s3_bucket}/in/raw.jsonl", rows(3).encode())
    assert local_copy(url).read_text() == rows(3) and gets() == 2
    assert local_copy(url).read_text() == rows(3) and gets() == 2
    now = {p for p in (repo / ".cache" / "remote" / "objects").rglob("*") if p.is_file() and p.suffix != ".json"}
    assert len(objects) == 1 and objects <= now  # still linked by elsewhere/same.jsonl
    s3().pipe(f"{s3_bucket}/elsewhere/same.jsonl", b"{}\n")
    local_copy(f"s3://{s3_bucket}/elsewhere/same.jsonl")
    assert not objects & {p for p in (repo / ".cache" / "remote" / "objects").rglob("*")}  # linked by none: gone
