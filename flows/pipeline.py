"""The DARE pipeline as one Prefect flow: each DVC stage in order, then the eval table.

    python -m flows.pipeline                          # inputs, prepare, sft, preference, rl, convert, eval
    python -m flows.pipeline --stages sft,rl --repo /path/to/project --force

Each stage is a Prefect task (`tasks.dvc_stage`) that runs `dvc repro --single-item <stage>` when
DVC says the stage changed; an unchanged stage is reported as skipped, and a changed one whose
outputs DVC checked out of its cache without running it as restored (with `run.artifact_root` set,
the task copies a restored stage's outputs there, and what an up-to-date stage's copies lack).
Everything a stage does is in `dvc.yaml`, so `dvc repro` alone reproduces the same run; this flow adds ordering, retries (a
rerun of a killed stage resumes from its checkpoints), a per-stage summary and the eval table as a
Prefect artifact. A flow run whose worker died is marked Crashed by the server (automations.yaml);
prefect.yaml's `dare-close-crashed-run` then closes the task runs it lost and puts the reason on the
run page (flows/attempts.py); its retry works in the same workspace, resumes each stage from its
checkpoints, counts the lost attempt's tries in the stage table and publishes nothing twice.

Parameter overrides: `overrides=["rl.num_steps=200"]` (a deployment parameter; `--set` here) sets
params.yaml keys for the run, recorded in the run's `dare-run` artifact; DVC tracks them as params
like `dvc exp run -S` does. `isolated=True` (deployments set it in prefect.yaml) runs in a git
worktree of the checkout's commit, so concurrent runs never collide (tasks/workspace.py).

Prefect shows each stage's output lines in its task's log (rate-limited), a failed stage's own
error line as the task's message, and per-stage artifacts (`dare-<stage>-report`: the metrics and
plots that stage wrote in this run; nothing for a stage that was up to date or restored: it
computed nothing in this run).

Prefect server: with `PREFECT_API_URL` unset, Prefect runs in ephemeral mode (a temporary local
API server inside this process; nothing to start). `main()` then keeps Prefect's state in
`<repo>/.cache/prefect` unless `PREFECT_HOME` is set (or a `~/.prefect/profiles.toml` exists,
which may point at a server). To see runs in the UI, start a server
(`dare server --host 127.0.0.1 --port 4200`: flows/server.py, with dare.env) and export
`PREFECT_API_URL=http://127.0.0.1:4200/api`. `prefect.yaml` at the repo root deploys this flow
to a `process` work pool named `dare`.
"""

from __future__ import annotations

import os
from pathlib import Path

from dare_core.process.env_file import apply_env_defaults, env_defaults

# dare.env (the Makefile's list) must be in the environment before Prefect reads its settings (at
# import): a deployment's worker is not started by make, and the stages inherit it (TORCH_EXTENSIONS_DIR:
# DeepSpeed's ops built once, not at every stage). A value the user set wins. PREFECT_HOME waits for
# main(), which keeps a Prefect setup the user chose.
apply_env_defaults(os.environ, Path(__file__).resolve().parents[1], skip=("PREFECT_HOME",))
# Prefect creates only the last level of PREFECT_HOME, and complains at import when its parent is
# missing ("Failed to create the Prefect home directory"), e.g. the Makefile's .cache/prefect.
if os.environ.get("PREFECT_HOME"):
    os.makedirs(os.path.expanduser(os.environ["PREFECT_HOME"]), exist_ok=True)

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402

from prefect import flow, get_run_logger  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402
from prefect.artifacts import create_markdown_artifact as _create_markdown_artifact  # noqa: E402
from prefect.artifacts import create_table_artifact as _create_table_artifact  # noqa: E402

from flows.attempts import EarlierAttempts, take_over  # noqa: E402
from flows.report import run_markdown, stage_markdown  # noqa: E402
from tasks.dvc_stage import StageResult, dvc_stage  # noqa: E402
from tasks.workspace import apply_overrides, checkout_state, create_workspace, end_run  # noqa: E402

# inputs records the input files' content (DVC runs it every time; prepare, rl and eval depend on
# it); preference is a side branch: it trains from the SFT model (as RL does) and exports its own
# folder. A project's dvc.yaml without one of them runs the others.
DEFAULT_STAGES = ["inputs", "prepare", "sft", "preference", "rl", "convert", "eval"]
EVAL_METRICS = "metrics/eval.json"


@dataclass
class PipelineResult:
    repo: str
    stages: list[StageResult] = field(default_factory=list)
    failed: str | None = None  # the stage that failed, if any
    metrics: dict | None = None  # metrics/eval.json as read after the stages
    table: str | None = None  # markdown eval table (None when there is no metrics file)

    def status(self, stage: str) -> str:
        for r in self.stages:
            if r.stage == stage:
                return r.status
        return "failed" if stage == self.failed else "not run"

    @property
    def ran(self) -> list[str]:
        return [r.stage for r in self.stages if r.ran]

    @property
    def restored(self) -> list[str]:
        """Stages DVC checked out of its cache: their outputs are this run's, computed by an earlier one."""
        return [r.stage for r in self.stages if r.status == "restored"]

    @property
    def skipped(self) -> list[str]:
        return [r.stage for r in self.stages if r.status == "skipped"]

    def stage_table(self) -> str:
        rows = ["| stage | status | attempts | wall time | why |", "|---|---|---|---|---|"]
        for r in self.stages:
            rows.append(f"| {r.stage} | {r.outcome} | {r.attempts} | {r.seconds:.1f} s | {r.reason} |")
        if self.failed:
            rows.append(f"| {self.failed} | FAILED | | | |")
        return "\n".join(rows)


def read_eval_metrics(repo: str | Path, path: str = EVAL_METRICS) -> dict | None:
    p = Path(repo) / path
    if not p.is_file():
        return None
    return json.loads(p.read_text())


def eval_rows(metrics: dict) -> list[dict]:
    """One row per checkpoint (every key but "artifacts", in file order): its score (0-100) on
    every benchmark, then the artifact path."""
    artifacts = metrics.get("artifacts") or {}
    rows = []
    for name, scores in metrics.items():
        if name == "artifacts" or not isinstance(scores, dict):
            continue
        rows.append({"checkpoint": name, **scores, "artifact": artifacts.get(name, "")})
    return rows


def eval_table(metrics: dict) -> str:
    """Markdown: checkpoint | one column per benchmark (accuracy %) | artifact path."""
    rows = eval_rows(metrics)
    benches: list[str] = []
    for row in rows:
        benches += [k for k in row if k not in ("checkpoint", "artifact") and k not in benches]
    lines = ["| checkpoint | " + " | ".join(benches) + " | artifact path |", "|---|" + "---|" * (len(benches) + 1)]
    for row in rows:
        cells = [f"{row[b]:.1f}" if isinstance(row.get(b), (int, float)) else "n/a" for b in benches]
        path = f"`{row['artifact']}`" if row["artifact"] else ""
        lines.append(f"| {row['checkpoint']} | " + " | ".join(cells) + f" | {path} |")
    return "\n".join(lines)


def defined_stages(repo: Path) -> list[str]:
    """The stages of `repo`'s dvc.yaml, in the file's order."""
    import yaml  # local: only needed here

    dvc_yaml = repo / "dvc.yaml"
    if not dvc_yaml.is_file():
        raise FileNotFoundError(f"no dvc.yaml in {repo}")
    return list((yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {})


def with_inputs(stages: list[str], defined: list[str]) -> list[str]:
    """`stages` led by `inputs` where dvc.yaml has it: each stage runs as `dvc repro --single-item`,
    which never runs an upstream stage, and the stages that read input files depend on its record."""
    if "inputs" in defined and stages and "inputs" not in stages:
        return ["inputs", *stages]
    return stages


def _check_stages(stages: list[str], repo: Path) -> None:
    """Fail before running anything if a stage is not in dvc.yaml (stage@item and file:stage pass)."""
    defined = set(defined_stages(repo))
    unknown = [s for s in stages if ":" not in s and s.split("@")[0] not in defined]
    if unknown:
        raise ValueError(f"stages not in {repo / 'dvc.yaml'}: {unknown} (defined: {sorted(defined)})")


def _check_config(root: Path) -> bool:
    """Load params.yaml as every stage will, before the first `dvc repro`: DVC removes a stage's
    outputs before the stage's own checks run, so an output folder set over the user's data or
    another output (dare_core/output_paths.py) must fail the flow here, with nothing deleted. A
    pipeline whose stages are not `dare stage` commands has no DARE config to check.
    Returns whether run.artifact_root is set (the stages then publish copies there)."""
    import yaml

    from dare_core.config import load_config

    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    if any(str((stage or {}).get("cmd", "")).startswith("dare ") for stage in stages.values() if isinstance(stage, dict)):
        return bool(load_config(root / "params.yaml", root=root).run.artifact_root)
    return False


@flow(name="dare-pipeline")
def dare_pipeline(
    stages: list[str] | None = None,
    repo: str = ".",
    force: bool = False,
    retries: int = 1,
    retry_delay_seconds: float = 2.0,
    overrides: list[str] | None = None,
    isolated: bool = False,
) -> PipelineResult:
    """Run the DVC stages in order (default: inputs, prepare, sft, preference, rl, convert, eval, those
    dvc.yaml has; `inputs` also leads a list of stages given), each as a Prefect
    task with `retries` retries, and publish what each stage produced in this run.

    overrides: params.yaml keys to set for this run (`["rl.num_steps=200"]`), written into the params.yaml
    the stages read, so DVC tracks them; recorded in the `dare-run` artifact.
    isolated: work in a git worktree of the checkout's commit (`.cache/workspaces/<flow run>`, DVC cache
    shared) instead of the checkout itself, so concurrent runs never collide and the checkout stays clean.
    Deployments set it (prefect.yaml); a run from the command line works in place by default. When an
    isolated run ends, its outcome is recorded in its workspace and old workspaces are pruned
    (`DARE_KEEP_WORKSPACES`, default 10; `off`: none; dare_core/process/workspaces.py has the rule).

    Returns a PipelineResult (per-stage ran/restored/skipped, attempts, wall time; eval metrics and table).
    A failing stage raises StageFailed (the worker's error line, the stage and its exit code).
    """
    logger = get_run_logger()
    attempt = flow_run.get_run_count()
    earlier = take_over(flow_run.get_id(), flow_run.get_name(), attempt)
    if earlier.closed:
        logger.warning("attempt %d: marked Crashed the task runs a lost attempt left open: %s",
                       attempt, ", ".join(earlier.closed))
    checkout = Path(repo).resolve()
    defined = defined_stages(checkout)
    stages = [s for s in DEFAULT_STAGES if s in defined] if stages is None else with_inputs(list(stages), defined)
    overrides = list(overrides or [])
    _check_stages(stages, checkout)
    commit, dirty = checkout_state(checkout) if (checkout / ".git").exists() else (None, [])
    if not isolated:
        return _run_in(checkout, stages, overrides, dict(checkout=checkout, commit=commit, isolated=False, dirty=dirty),
                       force=force, retries=retries, retry_delay_seconds=retry_delay_seconds, earlier=earlier)
    root, commit = create_workspace(checkout, _workspace_name())
    logger.info("isolated workspace %s (commit %s)", root, commit[:12])
    if dirty:
        logger.warning("uncommitted changes in %s are not part of this run: %s", checkout, ", ".join(dirty))
    outcome = "failed"  # also for an override typo: its workspace is kept a while, then pruned
    try:
        result = _run_in(root, stages, overrides, dict(checkout=checkout, commit=commit, isolated=True, dirty=dirty),
                         force=force, retries=retries, retry_delay_seconds=retry_delay_seconds, earlier=earlier)
        outcome = "ran"
        return result
    finally:
        end_run(checkout, root, outcome, say=logger.info, warn=logger.warning)


def _run_in(root: Path, stages: list[str], overrides: list[str], run_info: dict, *, force: bool, retries: int,
            retry_delay_seconds: float, earlier: EarlierAttempts) -> PipelineResult:
    """The body of a flow run, in `root` (the checkout or its workspace): the overrides, the
    `dare-run` artifact (`run_info`: where the run came from), each stage, the eval table. A stage's
    attempts count its tries in `earlier` attempts of the flow run too."""
    logger = get_run_logger()
    if overrides:
        applied = apply_overrides(root / "params.yaml", overrides)
        logger.info("params.yaml overrides: %s", ", ".join(f"{k}={v!r}" for k, v in applied))
    # a retried flow run lists the artifacts of all its attempts: what a lost one published stays
    create_markdown_artifact = _once(_create_markdown_artifact, earlier.published)
    create_table_artifact = _once(_create_table_artifact, earlier.published)
    create_markdown_artifact(
        key="dare-run",
        markdown=run_markdown(workdir=root, overrides=overrides, stages=stages, **run_info),
        description="where this run worked, its commit and params.yaml overrides",
    )
    publish = _check_config(root)
    run = dvc_stage.with_options(retries=retries, retry_delay_seconds=retry_delay_seconds)
    result = PipelineResult(repo=str(root))

    for stage in stages:
        t0, started = time.perf_counter(), time.time()
        try:
            r = run(stage, repo=str(root), force=force, publish=publish)
        except BaseException:
            result.failed = stage
            print(f"\nDARE pipeline FAILED at stage {stage!r} ({root})\n{result.stage_table()}", flush=True)
            raise
        result.stages.append(replace(r, seconds=time.perf_counter() - t0, attempts=r.attempts + earlier.tries[stage]))
        report = stage_markdown(stage.split("@")[0], root, started) if r.ran else None
        if report:  # only what this run wrote: a skipped or restored stage's files come from an earlier run
            create_markdown_artifact(key=f"dare-{_artifact_key(stage)}-report", markdown=report,
                                     description=f"{stage}: metrics and plots written by this run")

    summary = result.stage_table()
    create_table_artifact(
        key="dare-stages",
        table=[{"stage": r.stage, "status": r.outcome, "attempts": r.attempts,
                "seconds": round(r.seconds, 2), "why": r.reason} for r in result.stages],
        description=f"DARE pipeline stages ({root})",
    )

    result.metrics = read_eval_metrics(root)
    eval_ran = any(r.stage == "eval" and r.ran for r in result.stages)
    if result.metrics is not None:
        result.table = eval_table(result.metrics)
    if result.metrics is not None and eval_ran:
        create_markdown_artifact(
            key="dare-eval-table",
            markdown="## DARE evaluation (accuracy %, OpenCompass)\n\n" + result.table + "\n",
            description=f"{EVAL_METRICS} in {root}",
        )
        create_table_artifact(
            key="dare-eval-metrics",
            table=eval_rows(result.metrics),
            description=f"{EVAL_METRICS} in {root}",
        )
    elif result.metrics is not None:
        logger.info("eval did not run in this flow run: %s is from an earlier run, not republished", EVAL_METRICS)
    else:
        logger.info("no %s in %s: no eval table", EVAL_METRICS, root)

    out = [f"\nDARE pipeline ({root})", summary]
    if result.table:
        how = "restored from DVC's cache" if "eval" in result.restored else "up to date"
        out += ["", "Evaluation (accuracy %)" + ("" if eval_ran else f", from an earlier run (eval was {how})"),
                result.table]
    print("\n".join(out), flush=True)
    return result


def _once(create, published: set[str]):
    """`create` (a Prefect artifact function) skipping the keys an earlier attempt published."""
    def create_once(*, key: str, **kwargs):
        if key not in published:
            create(key=key, **kwargs)
    return create_once


def _workspace_name() -> str:
    """`<flow run name>-<id prefix>`: readable, and unique (run names are random word pairs, which
    repeat over many runs); a retry of the same flow run gets the same workspace back."""
    name, run_id = flow_run.get_name(), flow_run.get_id()
    return f"{name}-{str(run_id)[:8]}" if name and run_id else f"run-{os.getpid()}-{int(time.time())}"


def _artifact_key(stage: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", stage.lower()).strip("-")


def apply_run_env(repo: str | Path = ".") -> None:
    """Environment defaults for a run from the command line (never overriding what is set): `repo`'s
    dare.env, its PREFECT_HOME only where the user chose no Prefect home, server or profiles."""
    defaults = env_defaults(Path(repo))
    for key, value in defaults.items():
        if key != "PREFECT_HOME":
            os.environ.setdefault(key, value)
    # Prefect state in the repo, unless the user chose a home/server or has profiles of their own.
    if not any(k in os.environ for k in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_PROFILES_PATH")) \
            and not (Path.home() / ".prefect" / "profiles.toml").exists():
        os.environ["PREFECT_HOME"] = defaults.get("PREFECT_HOME", str(Path(repo).resolve() / ".cache" / "prefect"))
    if os.environ.get("PREFECT_HOME"):
        Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)  # Prefect creates only the last level


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flows.pipeline",
        description="Run the DARE pipeline (DVC stages as Prefect tasks).",
        epilog="Set PREFECT_API_URL to use a Prefect "
               "server (UI); otherwise Prefect runs in ephemeral mode.",
    )
    parser.add_argument("--stages", default=None,
                        help="comma-separated stages, in order (default: " + ",".join(DEFAULT_STAGES) + ")")
    parser.add_argument("--repo", default=".", help="project directory with dvc.yaml (default: .)")
    parser.add_argument("--force", action="store_true", help="rerun stages even if unchanged")
    parser.add_argument("--retries", type=int, default=1, help="retries per stage (default: 1)")
    parser.add_argument("--retry-delay", type=float, default=2.0, help="seconds between retries")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="set a params.yaml key for this run (repeatable), e.g. --set rl.num_steps=200")
    parser.add_argument("--isolated", action="store_true",
                        help="run in a git worktree of the checkout's commit (.cache/workspaces/<run>)")
    args = parser.parse_args(argv)

    apply_run_env(args.repo)
    import prefect.context

    prefect.context.refresh_global_settings_context()  # pick up the defaults set above

    stages = None if args.stages is None else [s.strip() for s in args.stages.split(",") if s.strip()]
    try:
        dare_pipeline(stages=stages, repo=args.repo, force=args.force,
                      retries=args.retries, retry_delay_seconds=args.retry_delay,
                      overrides=args.overrides, isolated=args.isolated)
    except Exception as exc:  # Prefect has logged the traceback
        print(f"dare pipeline failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
