"""A real S3 endpoint for tests: moto's server on 127.0.0.1, started and stopped by the test.

    from s3_server import s3_server, s3_bucket   # fixtures (or list this module in pytest_plugins)

    def test_x(s3_bucket):                      # a fresh bucket on the module's server
        url = f"s3://{s3_bucket}/data.jsonl"

`s3_server` (one server per test module) sets the standard AWS_* variables for the test's
process and the processes it starts (fake credentials, the endpoint, the region, no ~/.aws, no
instance metadata) and yields the endpoint: a str that also has `.log` (the server's request log)
and `.requests(method, path)`. `start_moto()` and `create_bucket()` are the same without pytest
(a DVC remote, a pipeline run in another process). The secret is distinctive (`SECRET`), so a test
can check that it never appears in any output.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional

from ports import unused_port

import pytest

REGION = "eu-west-1"  # not us-east-1, whose CreateBucket takes no location (one code path for both)
ACCESS_KEY = "AKIADARETESTKEY00000"
SECRET = "dare-test-secret-Zq8rV3kP9wX2"  # grep for it: it must never be printed or logged


class Endpoint(str):
    """The endpoint URL, plus the server's request log."""

    log: Path

    def requests(self, method: str, path: str = "") -> list[str]:
        """The logged requests with this HTTP method whose path starts with `path` ("/bucket/key")."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [m.group(0) for m in re.finditer(rf'"{method} (\S+) HTTP', text) if m.group(1).startswith(path)]


def aws_env(endpoint: str) -> dict[str, str]:
    """The variables botocore (and so s3fs, DVC's S3 remote, boto3) reads to reach this server."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL_S3": endpoint, "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": EMPTY_AWS_FILE, "AWS_CONFIG_FILE": EMPTY_AWS_FILE}


# an empty regular file, not /dev/null: dvc-s3 reads the config file when the path exists, and
# botocore's loader accepts only a regular file ("The specified config file (/dev/null) could not be found")
EMPTY_AWS_FILE = os.path.join(tempfile.gettempdir(), "dare-tests-empty-aws-config")
open(EMPTY_AWS_FILE, "a").close()


# unset by the fixture, so that a developer's own AWS settings cannot leak into a test
AWS_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_SECURITY_TOKEN")


def start_moto(port: Optional[int] = None, auth: bool = False,
               log: Optional[Path] = None) -> tuple[Endpoint, Callable[[], None]]:
    """Start moto's S3 server on 127.0.0.1 (`port`, or a free one); return (endpoint, stop).
    `auth`: the server checks credentials (any key is unknown to it, so every request is refused:
    the case of bad credentials). `log`: where its request log goes (default: a temporary file)."""
    port = port or unused_port()
    own_log = log is None
    if own_log:
        fd, name = tempfile.mkstemp(prefix="moto-", suffix=".log")
        os.close(fd)
        log = Path(name)
    log = Path(log)
    exe = Path(sys.executable).parent / "moto_server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    env = {**os.environ, **aws_env(f"http://127.0.0.1:{port}")}
    if auth:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    handle = log.open("w")
    proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=handle, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)
    endpoint = Endpoint(f"http://127.0.0.1:{port}")
    endpoint.log = log

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        handle.close()
        if own_log:
            log.unlink(missing_ok=True)

    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return endpoint, stop
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                told = log.read_text(errors="replace")[-2000:]
                stop()
                raise RuntimeError(f"moto server did not start: {told}")
            time.sleep(0.05)


def create_bucket(endpoint: str, name: Optional[str] = None) -> str:
    """Create a bucket (a fresh unique name unless `name`) on the server; return its name."""
    import boto3

    name = name or f"dare-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET)
    client.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": REGION})
    return name


@pytest.fixture(scope="module")
def s3_server() -> Iterator[Endpoint]:
    """A moto S3 server for the test module, with the AWS_* environment pointing at it."""
    endpoint, stop = start_moto()
    with pytest.MonkeyPatch.context() as mp:
        for var in AWS_UNSET:
            mp.delenv(var, raising=False)
        for var, value in aws_env(endpoint).items():
            mp.setenv(var, value)
        try:
            yield endpoint
        finally:
            stop()


@pytest.fixture
def s3_bucket(s3_server: Endpoint) -> str:
    """A new, empty bucket on the module's server."""
    return create_bucket(s3_server)
