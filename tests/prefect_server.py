"""A real Prefect server on 127.0.0.1 for tests, started as docs/operating.md says (`dare server`, which
fills in dare.env) in a fresh PREFECT_HOME, plus helpers to deploy from a project folder, run a
process worker and wait for flow runs.

The server, the CLI and the workers start from an environment without dare.env's variables (as an
operator's shell has it: what they need of it, `dare server`, the flow and its stages fill in), and
with every HTTP(S) proxy variable pointing at `outbound`, a listener that records each connection:
a call meant for beyond this machine (telemetry, a registry, Prefect Cloud) arrives there, while
NO_PROXY keeps 127.0.0.1 (this server, moto's S3) direct.

The server's scheduler loop is shortened (default 60 s) so that an interval schedule creates runs
within seconds; everything else is as dare.env and Prefect's defaults have it.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from dare_core.process.env_file import ENV_FILE, read_env_file

PREFECT = [sys.executable, "-m", "prefect"]
DARE = [sys.executable, "-m", "dare_core.cli"]  # `dare`, as the tests' subprocesses run it


class OutboundRecorder:
    """A TCP listener on 127.0.0.1 that records the first line each connection sends (`CONNECT
    host:443 HTTP/1.1` from a client that goes through it to an HTTPS address) and refuses it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.seen: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def proxy_env(self) -> dict[str, str]:
        proxies = {f"{scheme}_proxy": self.url for scheme in ("http", "https", "all")}
        local = {"no_proxy": "127.0.0.1,localhost"}
        return {k2: v for k, v in {**proxies, **local}.items() for k2 in (k, k.upper())}

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.seen.append(conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace") or "(nothing sent)")
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError as exc:
                    self.seen.append(f"(connected: {exc})")

    def close(self) -> None:
        self.sock.close()


# what an operator's shell lacks: dare.env's variables (the Makefile exports them to the tests)
DARE_ENV_KEYS = tuple(read_env_file(Path(__file__).resolve().parents[1] / ENV_FILE))


@dataclass
class PrefectServer:
    home: Path
    port: int
    proc: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    outbound: OutboundRecorder = field(default_factory=OutboundRecorder)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"{self.url}/api"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (*DARE_ENV_KEYS, "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")}
        env.update(
            PREFECT_HOME=str(self.home), PREFECT_API_URL=self.api, PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
            PREFECT_WORKER_QUERY_SECONDS="2", PREFECT_WORKER_PREFETCH_SECONDS="30",
            PREFECT_UI_API_URL=self.api, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            **self.outbound.proxy_env(),
        )
        env.update(extra)
        return env

    def start(self, timeout: float = 120) -> "PrefectServer":
        self.home.mkdir(parents=True, exist_ok=True)
        log = open(self.home / "server.log", "wb")
        self.proc = subprocess.Popen([*DARE, "server", "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited: {(self.home / 'server.log').read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.api}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.5)
        raise TimeoutError(f"prefect server not healthy after {timeout} s")

    def cli(self, *args: str, cwd: Path | str | None = None, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([*PREFECT, *args], cwd=cwd, env=self.env(**env), capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def start_worker(self, pool: str, cwd: Path | str, limit: int | None = None, **env: str) -> subprocess.Popen:
        name = f"worker-{len(self.workers)}"
        log = open(self.home / f"{name}.log", "wb")
        cmd = [*PREFECT, "worker", "start", "--pool", pool, "--name", name]
        if limit is not None:
            cmd += ["--limit", str(limit)]
        worker = subprocess.Popen(cmd, cwd=cwd, env=self.env(**env), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.workers.append(worker)
        return worker

    def kill_worker(self, worker: subprocess.Popen) -> None:
        """SIGKILL a worker and every process under it (its flow runs and their stages), as a host
        that dies takes them all: each is stopped (SIGSTOP) before any is killed, so none can start
        another or outlive its parent unseen, and none reports anything to the server."""
        root = psutil.Process(worker.pid)
        stopped: dict[int, psutil.Process] = {}
        while found := [p for p in [root, *root.children(recursive=True)] if p.pid not in stopped]:
            for p in found:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGSTOP)
                stopped[p.pid] = p
        for p in stopped.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        worker.wait()

    def worker_log(self, index: int = 0) -> str:
        return (self.home / f"worker-{index}.log").read_text(errors="replace")

    def server_log(self) -> str:
        return (self.home / "server.log").read_text(errors="replace")

    def stop(self) -> None:
        self.outbound.close()
        # a worker stops on SIGINT (twice), not SIGTERM; the server on SIGTERM
        for proc, sig in [*((w, signal.SIGINT) for w in self.workers), (self.proc, signal.SIGTERM)]:
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
                if sig == signal.SIGINT:
                    time.sleep(0.5)
                    os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def flow_runs(server: PrefectServer, deployment_id: str | None = None, states: list[str] | None = None) -> list[dict]:
    """Flow runs (latest expected start first) as the REST API returns them, optionally only those in
    the given state types (COMPLETED, SCHEDULED, ...)."""
    body: dict = {"sort": "EXPECTED_START_TIME_DESC", "limit": 200, "flow_runs": {}}
    if deployment_id:
        body["flow_runs"]["deployment_id"] = {"any_": [deployment_id]}
    if states:
        body["flow_runs"]["state"] = {"type": {"any_": states}}
    return api_post(server, "flow_runs/filter", body)


def api_post(server: PrefectServer, path: str, body: dict) -> list | dict:
    return _request(urllib.request.Request(f"{server.api}/{path}", data=json.dumps(body).encode(),
                                           headers={"Content-Type": "application/json"}, method="POST"))


def api_get(server: PrefectServer, path: str) -> list | dict:
    return _request(urllib.request.Request(f"{server.api}/{path}"))


def _request(req: urllib.request.Request, attempts: int = 5) -> list | dict:
    """The server answers 503 when SQLite stays locked (a busy machine): its transaction was rolled
    back, and Prefect's own client retries it, as this does. On 2 busy cores an answer can also
    take longer than the socket's wait; a read (GET, or a POST to a `/filter` query) is then asked
    again, while a write is not (it may have been carried out)."""
    reads = req.get_method() == "GET" or req.full_url.endswith("/filter")
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == attempts - 1:
                raise
        except (TimeoutError, urllib.error.URLError) as e:
            timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
            if not (reads and timed_out) or attempt == attempts - 1:
                raise
        time.sleep(1 + attempt)


def wait_for(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
