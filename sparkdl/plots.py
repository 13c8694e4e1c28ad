"""Training-history charts (matplotlib, an optional dependency: ``pip install sparkdl[plots]``)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd


def plot_history(history: pd.DataFrame, path: str | Path, gradients: pd.DataFrame | None = None,
                 title: str = "") -> Path:
    """Write a PNG: loss vs time, loss vs step and, when gradients were stale, a staleness histogram."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_history needs matplotlib: pip install 'sparkdl[plots]'") from exc
    stale = gradients is not None and len(gradients) and gradients["staleness"].max() > 0
    figure, axes = plt.subplots(1, 3 if stale else 2, figsize=(15 if stale else 10, 4))
    axes[0].plot(history["time_s"], history["loss"], linewidth=0.8)
    axes[0].set(xlabel="seconds", ylabel="training loss", title="loss vs time")
    axes[1].plot(history["version"], history["loss"], linewidth=0.8)
    axes[1].set(xlabel="update (PS version)", ylabel="training loss", title="loss vs step")
    for axis in axes[:2]:
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
    if stale:
        counts = gradients["staleness"].value_counts().sort_index()
        axes[2].bar(counts.index, counts.values)
        axes[2].set(xlabel="staleness (versions)", ylabel="gradients", title="staleness distribution")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
