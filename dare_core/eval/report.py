"""Plots of evaluation results."""
from __future__ import annotations

from pathlib import Path


def accuracy_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    acc = [results[n]["accuracy"] * 100 for n in names]
    fig, ax = plt.subplots(figsize=(4, 3), dpi=120)
    bars = ax.bar(names, acc, color=["#999999", "#4c72b0", "#dd8452"][: len(names)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(0, 105)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
