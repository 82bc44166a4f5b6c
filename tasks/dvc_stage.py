"""One Prefect task per pipeline stage: run a DVC stage and report whether it ran or was skipped.

The task is thin on purpose. Everything a stage does lives in `dvc.yaml` (its cmd is
`dare stage <name>`), so the task only asks DVC:

1. `dvc status <stage> --json`: has anything the stage depends on (deps, params, cmd, outs) changed?
2. if so (or if forced): `dvc repro --single-item [--force] <stage>` as a subprocess in the repo
   directory. Its stdout and stderr are echoed live, chunk by chunk, to ours (the workers' tqdm
   bars, which redraw with `\\r`, show up as they happen), and their complete lines go to the
   task's Prefect log, rate-limited (tasks/stage_output.py).

An unchanged stage is reported as skipped without calling `dvc repro` (DVC would only print
"Stage '<name>' didn't change, skipping"). A changed stage whose outputs DVC finds in its cache
(dvc.lock's, or the run cache's for these deps, params and cmd) is checked out without running its
cmd ("Stage '<name>' is cached - skipping run, checking out outputs"): reported as restored. Such a
stage never ran `dare stage`, which copies the outputs to `run.artifact_root`, so with `publish`
(the flow sets it when the root is set) the task runs `dare upload` for it: for a `dare stage`
cmd, the same upload the stage does; for a stage found up to date, `dare upload --missing`, which
sends only what the root lacks. A failed stage raises `StageFailed`, whose message is the worker's
own error line (`error: unknown config key ...`) followed by the stage and its exit code; the
task's retries rerun it, and the worker resumes from its checkpoints.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.logging.handlers import APILogHandler
from prefect.logging.loggers import PrefectLogAdapter
from prefect.runtime import task_run

from dare_core.process.env_file import apply_env_defaults
from dare_core.process.exits import killed_by, signal_of
from tasks.stage_output import WORKER_ERROR, LineForwarder, dvc_error, error_line, line_level

__all__ = ["StageFailed", "StageResult", "dvc_stage", "run_stage", "stage_changes"]

# a task's stage output goes to the API alone (to_ui_only)
STAGE_OUTPUT_LOGGER = "prefect.task_runs.stage_output"

# DVC 3's line (dvc/stage/cache.py) for a stage it checks out of its cache instead of running
RESTORED = re.compile(r"^Stage '[^']+' is cached - skipping run, checking out outputs", re.M)
# a training stage's line when it continues from a checkpoint (dare_core/training/checkpoint.py)
RESUMED = re.compile(r"resuming .+? from \S+ \(step (\d+)")


class StageFailed(RuntimeError):
    """A stage failed. Its message starts with the line that explains why: the worker's own
    `error: ...` line when it printed one (`error_line`), else DVC's report. `returncode` is the
    stage cmd's exit code when DVC reported it ("exited with N"), else the DVC command's own exit
    code (`dvc_returncode`; DVC exits 255 on any error). `signal` is the signal that code carries
    (dare_core/process/exits.py), if any: a killed stage is reported as killed, by name, not by a number
    (DVC reports `-9`, a shell `137`, the DeepSpeed launcher `247`)."""

    def __init__(self, stage: str, dvc_returncode: int, command: list[str], repo: str | Path,
                 dvc_error: str = "", cause: str = ""):
        m = re.search(r"exited with (-?\d+)", dvc_error)
        self.stage = stage
        self.returncode = int(m.group(1)) if m else dvc_returncode
        self.signal = signal_of(self.returncode)
        self.dvc_returncode = dvc_returncode
        self.dvc_error = dvc_error
        self.cause = cause if cause and cause != dvc_error else ""
        if self.signal is not None and not WORKER_ERROR.match(self.cause):
            self.cause = ""  # the last line a killed stage printed is not why it died
        self.command = command
        self.repo = str(repo)
        super().__init__(self._message())

    def _message(self) -> str:
        failed = f"stage {self.stage!r} failed with exit code {self.returncode}"
        if self.signal is not None:
            killed = f"stage {self.stage!r} was {killed_by(self.signal)}"
            if f"killed by {self.signal.name}" in self.cause:  # the worker's line already says how
                return f"{self.cause} [{failed}]"
            return f"{self.cause} [{killed}]" if self.cause else killed
        if self.cause:
            return f"{self.cause} [{failed}]"
        return failed + (f" (dvc: {self.dvc_error.removeprefix('ERROR: ')})" if self.dvc_error else "")

    def __reduce__(self):  # picklable (Prefect may serialize exceptions)
        return (type(self), (self.stage, self.dvc_returncode, self.command, self.repo, self.dvc_error, self.cause))


@dataclass(frozen=True)
class StageResult:
    stage: str
    # ran: the cmd ran; restored: DVC checked the outputs out of its cache (nothing computed);
    # skipped: up to date
    status: str
    seconds: float  # wall time of the last attempt (the flow overwrites it with the total)
    attempts: int = 1
    reason: str = ""  # what DVC saw changed, e.g. "changed deps, changed outs"; "forced"
    resumed_from: int | None = None  # the step of the checkpoint the stage continued from

    @property
    def ran(self) -> bool:
        return self.status == "ran"

    @property
    def outcome(self) -> str:
        """The status, and for a stage that continued from a checkpoint, from which step."""
        return f"{self.status}, resumed from step {self.resumed_from}" if self.resumed_from is not None else self.status


def dvc_command(*args: str) -> list[str]:
    """`dvc ...` from the same Python environment as this process."""
    return [sys.executable, "-m", "dvc", *args]


def stage_env(repo: str | Path | None = None) -> dict[str, str]:
    """Environment of the DVC subprocess: ours, filled in from the project's dare.env (DVC analytics
    off, DeepSpeed's ops built once into the project's .cache/torch_extensions, ...; what is set
    wins), this Python's bin dir first on PATH (a stage cmd `dare stage <name>` resolves to this
    environment's `dare`) and the project first on PYTHONPATH, so a stage runs the dare_core of the
    checkout or workspace it runs in (the code dvc.yaml's deps hash), not whichever copy is installed."""
    env = apply_env_defaults(dict(os.environ), None if repo is None else Path(repo))
    env.setdefault("DARE_LOG_STEPS", "1")  # workers print a line per logged step, which the task forwards
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        env["PATH"] = bindir + (os.pathsep + path if path else "")
    if repo is not None and (Path(repo) / "dare_core").is_dir():
        env["PYTHONPATH"] = os.pathsep.join([str(Path(repo).resolve()), *filter(None, [env.get("PYTHONPATH")])])
    return env


def stage_changes(stage: str, repo: str | Path = ".") -> list:
    """What `dvc status <stage> --json` reports for the stage; an empty list means up to date."""
    cmd = dvc_command("status", stage, "--json")
    proc = subprocess.run(
        cmd, cwd=repo, env=stage_env(repo), stdin=subprocess.DEVNULL,
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise StageFailed(stage, proc.returncode, cmd, repo, dvc_error(proc.stderr))
    out = proc.stdout.strip()
    # DVC may print warnings before the JSON object; the JSON is the last line.
    status = json.loads(out.splitlines()[-1]) if out else {}
    changes: list = []
    for value in status.values():  # {"<stage>": [...]} (keys may be "dvc.yaml:<stage>")
        changes.extend(value if isinstance(value, list) else [value])
    return changes


def _describe(changes: list) -> str:
    parts: list[str] = []
    for change in changes:
        for item in (change if isinstance(change, dict) else {change: None}):
            if str(item) not in parts:
                parts.append(str(item))
    return ", ".join(parts)


def _pump(fd: int, stream: str, sink, forward: LineForwarder | None, tails: dict[str, str]) -> None:
    """Copy one pipe to our console stream, chunk by chunk (tqdm's `\\r` redraws pass through
    unchanged), and into the line forwarder and the shared output tail."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while chunk := os.read(fd, 65536):
        text = decoder.decode(chunk)
        try:
            sink.write(text)
            sink.flush()
        except (OSError, ValueError):  # our console is gone: keep draining the pipe
            pass
        if forward is not None:
            forward.feed(text, stream)
        tails[stream] = (tails[stream] + text)[-16384:]


def _run_streaming(cmd: list[str], repo: str | Path, forward: LineForwarder | None = None,
                   env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run cmd with its stdout and stderr echoed live to ours and fed, line by line, to `forward`.
    Returns (exit code, the last 16 KB of stdout then of stderr: kept apart, since lines of the two
    interleave mid-line)."""
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(cmd, cwd=repo, env=env or stage_env(repo), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tails = {"stdout": "", "stderr": ""}
    pumps = [threading.Thread(target=_pump, args=(pipe.fileno(), name, sink, forward, tails), daemon=True)
             for pipe, name, sink in ((proc.stdout, "stdout", sys.stdout), (proc.stderr, "stderr", sys.stderr))]
    try:
        for t in pumps:
            t.start()
        for t in pumps:
            t.join()
        return proc.wait(), tails["stdout"] + "\n" + tails["stderr"]
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        if forward is not None:
            forward.close()


def upload_command(stage: str, repo: str | Path, missing_only: bool) -> list[str] | None:
    """`dare upload` for a dvc.yaml stage whose cmd is `dare stage ...` (None for any other stage),
    run by this Python on the project's own dare_core (stage_env)."""
    import yaml

    from dare_core.cli import upload_argv

    stages = (yaml.safe_load((Path(repo) / "dvc.yaml").read_text()) or {}).get("stages") or {}
    cmd = (stages.get(stage) or {}).get("cmd") if isinstance(stages.get(stage), dict) else None
    argv = upload_argv(cmd) if isinstance(cmd, str) else None
    return None if argv is None else [sys.executable, "-m", "dare_core.cli", *argv, *(["--missing"] if missing_only else [])]


def run_stage(stage: str, repo: str | Path = ".", force: bool = False, attempt: int = 1,
              log_line: Callable[[str], None] | None = None, env: dict[str, str] | None = None,
              publish: bool = False) -> StageResult:
    """Run one DVC stage if it changed (or if forced). Plain function: no Prefect needed.
    `log_line` receives the stage's output lines (rate-limited; see tasks/stage_output.py).
    `publish`: run.artifact_root is set, so a stage restored or up to date gets its copies there
    (module docstring)."""
    t0 = time.perf_counter()
    changes = [] if force else stage_changes(stage, repo)
    reason = "forced" if force else _describe(changes) if changes else "up to date"
    status = "skipped"
    resumed: list[int] = []

    def watch(line: str) -> None:
        if not resumed and (m := RESUMED.search(line)):
            resumed.append(int(m.group(1)))

    if force or changes:
        cmd = dvc_command("repro", "--single-item", *(["--force"] if force else []), stage)
        returncode, tail = _run_streaming(cmd, repo, LineForwarder(log_line or (lambda _line: None), watch=watch), env)
        if returncode != 0:
            raise StageFailed(stage, returncode, cmd, repo, dvc_error(tail), error_line(tail))
        status = "restored" if RESTORED.search(tail) and "Running stage '" not in tail else "ran"
    upload = upload_command(stage, repo, missing_only=status == "skipped") if publish and status != "ran" else None
    if upload:
        returncode, tail = _run_streaming(upload, repo, LineForwarder(log_line) if log_line else None, env)
        if returncode != 0:
            why = error_line(tail) or f"dare upload exited with {returncode}"
            raise StageFailed(stage, returncode, upload, repo, cause=f"{why} (copying the {status} outputs to run.artifact_root)")
    return StageResult(stage, status, time.perf_counter() - t0, attempt, reason, resumed[0] if resumed else None)


def to_ui_only(logger: logging.LoggerAdapter) -> Callable[[str], None]:
    """Log a stage's output lines to the task's Prefect log (the UI) and not to the console: the
    console already shows them, echoed live, and Prefect's console handler would print each twice.
    Each line at the level it states (`line_level`), so that the UI's error filter finds why a
    stage failed."""
    quiet = logging.getLogger(STAGE_OUTPUT_LOGGER)
    if not any(isinstance(h, APILogHandler) for h in quiet.handlers):
        quiet.addHandler(APILogHandler())
        quiet.setLevel(logging.INFO)
        quiet.propagate = False  # prefect.task_runs' parents end at the root's console handler
    adapter = PrefectLogAdapter(quiet, extra=dict(logger.extra or {}))
    return lambda line: adapter.log(line_level(line), "%s", line)


@task(
    name="dvc-stage",
    task_run_name="{stage}",
    retries=1,
    retry_delay_seconds=2,
    cache_policy=NO_CACHE,  # DVC is the cache
    persist_result=False,
)
def dvc_stage(stage: str, repo: str = ".", force: bool = False, publish: bool = False) -> StageResult:
    """Prefect task: `dvc repro --single-item <stage>` when DVC says the stage changed. The stage's
    output lines go to this task's Prefect log; a failure's message is the worker's error line.
    `publish`: copy the outputs of a stage restored or up to date to run.artifact_root.

    Retries are set per call from the flow with `dvc_stage.with_options(retries=..., ...)`.
    """
    logger = get_run_logger()
    attempt = int(task_run.run_count or 1)
    logger.info("stage %s: attempt %d in %s", stage, attempt, repo)
    try:
        result = run_stage(stage, repo, force=force, attempt=attempt, log_line=to_ui_only(logger), publish=publish)
    except StageFailed as exc:
        # Prefect itself reports a failed try at INFO when a retry follows: the reason is an error
        logger.error("stage %s failed (attempt %d): %s", stage, attempt, exc)
        raise
    logger.info("stage %s: %s in %.1f s (%s)", stage, result.status, result.seconds, result.reason)
    return result
