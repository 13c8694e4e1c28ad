"""Training-history charts (matplotlib, an optional dependency: ``pip install sparkdl[plots]``)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

__all__ = ["plot_history"]


def plot_history(history: pd.DataFrame, path: str | Path, gradients: pd.DataFrame | None = None,
                 title: str = "", validation: pd.DataFrame | None = None) -> Path:
    """Write a PNG: training loss (raw and smoothed) vs time and vs step, the validation curves
    when there are any, and a staleness histogram when gradients were stale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_history needs matplotlib: pip install 'sparkdl[plots]'") from exc
    stale = gradients is not None and len(gradients) and gradients["staleness"].max() > 0
    validated = validation is not None and len(validation) > 0
    panels = 2 + bool(validated) + bool(stale)
    figure, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    # an exponential moving average over ~2% of the updates shows the trend through the noise
    smoothed = history["loss"].ewm(span=max(5, len(history) // 50)).mean()
    for axis, x, label in ((axes[0], history["time_s"], "seconds"), (axes[1], history["version"], "update (PS version)")):
        axis.plot(x, history["loss"], linewidth=0.6, alpha=0.35, label="training loss")
        axis.plot(x, smoothed, linewidth=1.5, label="smoothed")
        axis.set(xlabel=label, ylabel="loss", title=f"loss vs {'time' if axis is axes[0] else 'step'}")
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
    if validated:
        assert validation is not None
        axes[1].plot(validation["version"], validation["val_loss"], marker="o", label="validation loss")
        metric_axis = axes[2]
        metric_axis.plot(validation["epoch"] + 1, validation["val_metric"], marker="o", color="tab:green")
        metric_axis.set(xlabel="epoch", ylabel="validation metric", title="validation (accuracy or RMSE)")
        metric_axis.grid(alpha=0.3)
    axes[1].legend()
    if stale:
        assert gradients is not None
        counts = gradients["staleness"].value_counts().sort_index()
        axes[-1].bar(counts.index, counts.values)
        axes[-1].set(xlabel="staleness (versions)", ylabel="gradients", title="staleness distribution")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
