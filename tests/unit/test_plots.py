"""History charts: raw and smoothed training loss, validation curves, staleness."""
import pandas as pd
import pytest

pytest.importorskip("matplotlib")

from sparkdl.plots import plot_history  # noqa: E402


def test_history_chart_with_validation_curves(tmp_path):
    history = pd.DataFrame({"version": range(1, 201), "time_s": [0.01 * v for v in range(1, 201)],
                            "loss": [2.0 / v ** 0.5 for v in range(1, 201)]})
    validation = pd.DataFrame({"epoch": [0, 1, 2], "version": [60, 130, 200], "val_loss": [0.5, 0.3, 0.35],
                               "val_metric": [0.8, 0.9, 0.88]})
    gradients = pd.DataFrame({"staleness": [0, 1, 2, 1]})
    out = plot_history(history, tmp_path / "history.png", gradients, title="t", validation=validation)
    assert out.stat().st_size > 10_000
    without = plot_history(history, tmp_path / "plain.png")
    assert without.stat().st_size > 5_000
