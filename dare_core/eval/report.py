"""Tables and plots of evaluation results: {model: {benchmark: accuracy (0-100)}}."""
from __future__ import annotations

import io
from pathlib import Path

from dare_core.storage import atomic_write_bytes


def _benchmarks(results: dict) -> list:
    names: list = []
    for scores in results.values():
        names += [b for b in scores if b not in names]
    return names


def results_table(results: dict) -> str:
    """A markdown table: one row per benchmark, one column per model (the DARE table's shape)."""
    models = list(results)
    lines = ["| benchmark | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for bench in _benchmarks(results):
        cells = [f"{results[m][bench]:.2f}" if bench in results[m] else "-" for m in models]
        lines.append(f"| {bench} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_plot(results: dict, path: Path) -> None:
    """Grouped bars: benchmarks on the x axis, one bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models, benches = list(results), _benchmarks(results)
    width = 0.8 / max(len(models), 1)
    x = np.arange(len(benches))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(benches) * max(len(models), 1) * 0.6 + 1.5), 3.2), dpi=120)
    colors = ["#999999", "#4c72b0", "#55a868", "#dd8452", "#8172b2", "#c44e52"]
    for i, m in enumerate(models):
        values = [results[m].get(b, 0.0) for b in benches]
        bars = ax.bar(x + (i - (len(models) - 1) / 2) * width, values, width, label=m, color=colors[i % len(colors)])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(x, benches)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())  # one rename: a reader never sees half a plot
