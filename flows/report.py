"""What a pipeline run shows in Prefect: per-stage metrics and plots, and the run's own settings.

Only files a stage wrote during this flow run are reported (modified after the stage started), so a
run that skipped a stage never republishes an older run's numbers as its own.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

from dare_core.storage import read_yaml_mapping

# the largest PNG embedded in an artifact; bigger ones are linked by path only
MAX_EMBED_BYTES = 400_000


@dataclass(frozen=True)
class RunPaths:
    metrics_dir: Path
    runs_dir: Path
    name: str

    @classmethod
    def read(cls, workdir: Path) -> "RunPaths":
        """run.* of the workdir's params.yaml (the DARE layout), with DARE's defaults."""
        params = workdir / "params.yaml"
        run = {}
        if params.is_file():
            run = read_yaml_mapping(params).get("run") or {}
        return cls(workdir / str(run.get("metrics_dir") or "metrics"), workdir / str(run.get("runs_dir") or "runs"),
                   str(run.get("name") or "embedded"))

    def stage_files(self, stage: str) -> tuple[Path, list[Path]]:
        """(metrics/<stage>.json, the stage's PNG plots)."""
        stage_dir = self.runs_dir / self.name / stage
        return self.metrics_dir / f"{stage}.json", sorted(stage_dir.glob("*.png")) if stage_dir.is_dir() else []


def fresh(path: Path, since: float) -> bool:
    """Written at or after `since` (a wall-clock time), with a second's slack for coarse mtimes."""
    return path.is_file() and path.stat().st_mtime >= since - 1.0


def flatten(metrics: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[name] = value
    return out


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace("|", "\\|")


def stage_markdown(stage: str, workdir: Path, since: float) -> str | None:
    """Markdown for one stage that ran in this flow run: its metrics table and its plots (embedded
    as images). None when the stage wrote neither."""
    paths = RunPaths.read(workdir)
    metrics_file, plots = paths.stage_files(stage)
    parts = [f"## {stage}: metrics of this run"]
    if fresh(metrics_file, since):
        rows = flatten(json.loads(metrics_file.read_text()))
        parts += ["", f"`{metrics_file.relative_to(workdir)}`", "", "| metric | value |", "|---|---|"]
        parts += [f"| {k} | {_cell(v)} |" for k, v in rows.items()]
    plots = [p for p in plots if fresh(p, since)]
    for png in plots:
        rel = png.relative_to(workdir)
        parts += ["", f"### {png.stem}", ""]
        data = png.read_bytes()
        if len(data) <= MAX_EMBED_BYTES:
            parts.append(f"![{png.stem}](data:image/png;base64,{base64.b64encode(data).decode()})")
        parts.append(f"`{rel}`")
    return "\n".join(parts) + "\n" if len(parts) > 1 else None


def run_markdown(*, checkout: Path, workdir: Path, commit: str | None, overrides: list[str],
                 stages: list[str], isolated: bool, dirty: list[str]) -> str:
    """The run's own settings: where it ran, which commit, which params.yaml overrides."""
    lines = ["## DARE run", "", "| setting | value |", "|---|---|",
             f"| checkout | `{checkout}` |", f"| workspace | `{workdir}`{' (isolated git worktree)' if isolated else ''} |",
             f"| commit | `{commit or 'not a git checkout'}` |", f"| stages | {', '.join(stages)} |"]
    lines.append("| overrides | " + (", ".join(f"`{o}`" for o in overrides) if overrides else "none") + " |")
    if isolated and dirty:
        lines += ["", "Uncommitted changes in the checkout were not part of this run: "
                  + ", ".join(f"`{d}`" for d in dirty)]
    return "\n".join(lines) + "\n"
