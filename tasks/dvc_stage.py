"""One Prefect task per pipeline stage: run a DVC stage and report whether it ran or was skipped.

The task is thin on purpose. Everything a stage does lives in `dvc.yaml` (its cmd is
`dare stage <name>`), so the task only asks DVC:

1. `dvc status <stage> --json`: has anything the stage depends on (deps, params, cmd, outs) changed?
2. if so (or if forced): `dvc repro --single-item [--force] <stage>` as a subprocess in the repo
   directory. Its stdout is this process's stdout (inherited file descriptor); its stderr is
   forwarded live, chunk by chunk, to sys.stderr, so the workers' tqdm bars (which redraw with
   `\\r`) show up as they happen, and DVC's error line ("... exited with N") is kept for the error.

An unchanged stage is reported as skipped without calling `dvc repro` (DVC would only print
"Stage '<name>' didn't change, skipping"). A failed stage raises `StageFailed` naming the stage and
the stage command's exit code; the task's retries rerun it, and the worker resumes from its checkpoints.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

__all__ = ["StageFailed", "StageResult", "dvc_stage", "run_stage", "stage_changes"]


class StageFailed(RuntimeError):
    """A stage failed: `returncode` is the stage cmd's exit code when DVC reported it ("exited
    with N"), else the DVC command's own exit code (`dvc_returncode`; DVC exits 255 on any error)."""

    def __init__(self, stage: str, dvc_returncode: int, command: list[str], repo: str | Path,
                 dvc_error: str = ""):
        m = re.search(r"exited with (-?\d+)", dvc_error)
        self.stage = stage
        self.returncode = int(m.group(1)) if m else dvc_returncode
        self.dvc_returncode = dvc_returncode
        self.dvc_error = dvc_error
        self.command = command
        self.repo = str(repo)
        detail = f" (dvc: {dvc_error.removeprefix('ERROR: ')})" if dvc_error else ""
        super().__init__(f"stage {stage!r} failed with exit code {self.returncode}{detail}")

    def __reduce__(self):  # picklable (Prefect may serialize exceptions)
        return (type(self), (self.stage, self.dvc_returncode, self.command, self.repo, self.dvc_error))


@dataclass(frozen=True)
class StageResult:
    stage: str
    status: str  # "ran" | "skipped"
    seconds: float  # wall time of the last attempt (the flow overwrites it with the total)
    attempts: int = 1
    reason: str = ""  # what DVC saw changed, e.g. "changed deps, changed outs"; "forced"

    @property
    def ran(self) -> bool:
        return self.status == "ran"


def dvc_command(*args: str) -> list[str]:
    """`dvc ...` from the same Python environment as this process."""
    return [sys.executable, "-m", "dvc", *args]


def stage_env() -> dict[str, str]:
    """Environment of the DVC subprocess: ours, plus DVC analytics off and this Python's bin dir
    first on PATH, so a stage cmd `dare stage <name>` resolves to this environment's `dare`."""
    env = dict(os.environ)
    env.setdefault("DVC_NO_ANALYTICS", "1")
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        env["PATH"] = bindir + (os.pathsep + path if path else "")
    return env


def stage_changes(stage: str, repo: str | Path = ".") -> list:
    """What `dvc status <stage> --json` reports for the stage; an empty list means up to date."""
    cmd = dvc_command("status", stage, "--json")
    proc = subprocess.run(
        cmd, cwd=repo, env=stage_env(), stdin=subprocess.DEVNULL,
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise StageFailed(stage, proc.returncode, cmd, repo, _last_error(proc.stderr))
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


def _run_streaming(cmd: list[str], repo: str | Path) -> tuple[int, str]:
    """Run cmd with stdout inherited (our fd 1) and stderr forwarded live, chunk by chunk, to
    sys.stderr (tqdm's `\\r` redraws pass through unchanged). Returns (exit code, stderr tail)."""
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(cmd, cwd=repo, env=stage_env(), stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tail = ""
    try:
        assert proc.stderr is not None
        fd = proc.stderr.fileno()
        while chunk := os.read(fd, 65536):
            text = decoder.decode(chunk)
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone: keep draining the pipe
                pass
            tail = (tail + text)[-8192:]
        return proc.wait(), tail
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stderr.close()


def _last_error(stderr_tail: str) -> str:
    """DVC's last "ERROR: ..." line (it names the stage and the cmd's exit code)."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", stderr_tail) if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return errors[-1] if errors else (lines[-1] if lines else "")


def run_stage(stage: str, repo: str | Path = ".", force: bool = False, attempt: int = 1) -> StageResult:
    """Run one DVC stage if it changed (or if forced). Plain function: no Prefect needed."""
    t0 = time.perf_counter()
    if force:
        reason = "forced"
    else:
        changes = stage_changes(stage, repo)
        if not changes:
            return StageResult(stage, "skipped", time.perf_counter() - t0, attempt, "up to date")
        reason = _describe(changes)
    cmd = dvc_command("repro", "--single-item", *(["--force"] if force else []), stage)
    returncode, err_tail = _run_streaming(cmd, repo)
    if returncode != 0:
        raise StageFailed(stage, returncode, cmd, repo, _last_error(err_tail))
    return StageResult(stage, "ran", time.perf_counter() - t0, attempt, reason)


@task(
    name="dvc-stage",
    task_run_name="{stage}",
    retries=1,
    retry_delay_seconds=2,
    cache_policy=NO_CACHE,  # DVC is the cache
    persist_result=False,
)
def dvc_stage(stage: str, repo: str = ".", force: bool = False) -> StageResult:
    """Prefect task: `dvc repro --single-item <stage>` when DVC says the stage changed.

    Retries are set per call from the flow with `dvc_stage.with_options(retries=..., ...)`.
    """
    logger = get_run_logger()
    attempt = int(task_run.run_count or 1)
    logger.info("stage %s: attempt %d in %s", stage, attempt, repo)
    result = run_stage(stage, repo, force=force, attempt=attempt)
    logger.info("stage %s: %s in %.1f s (%s)", stage, result.status, result.seconds, result.reason)
    return result
