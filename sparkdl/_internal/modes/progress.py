"""Live progress of a training run on the driver, from the PS's own counters.

On a terminal or in a notebook it is a tqdm bar.  Elsewhere (spark-submit, a scheduler's log
file) it is a plain line every few seconds and one at the end: a redrawn bar would pile every
refresh onto one log line, separated by carriage returns.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any, Protocol, TextIO


class ProgressSource(Protocol):
    """What the display reads: ``ParameterServer`` and ``PSCore`` both have it."""

    def progress(self) -> dict[str, Any]:
        """The view documented in ``sparkdl._internal.ps.server.run_progress.run_progress``."""
        ...


def in_notebook() -> bool:
    """True inside a Jupyter kernel, where tqdm draws a widget although stderr is not a terminal."""
    if "IPython" not in sys.modules:       # never import IPython just to find out
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def is_interactive(stream: TextIO) -> bool:
    """Whether a redrawn bar suits ``stream``: a terminal, or the stderr of a notebook."""
    isatty = getattr(stream, "isatty", None)
    try:
        if isatty is not None and isatty():
            return True
    except ValueError:                     # a closed stream
        return False
    return in_notebook()


def format_fields(view: dict[str, Any]) -> str:
    """The figures of one progress view, as ``key=value`` pairs."""
    loss = view["loss"]
    rate = view["samples"] / view["window_s"] if view["window_s"] else float("nan")
    validation = view.get("val_loss")
    return (f"epoch={view['epoch'] + 1} v={view['version']} loss={'-' if math.isnan(loss) else f'{loss:.4f}'} "
            + (f"val_loss={validation:.4f} " if validation is not None else "")
            + "".join(f"{name}={value:.4g} " for name, value in view.get("metrics", {}).items())
            + f"samples/s={'-' if math.isnan(rate) else f'{rate:,.0f}'} staleness={view['staleness']:.2f} "
            f"retries={view['retries']}" + (f" joins={view['joins']}" if view.get("joins") else "")
            + (f" workers={view['workers']}" if view.get("workers") is not None else ""))


PLURAL = {"push": "pushes", "sample": "samples"}


def progress_count(view: dict[str, Any]) -> tuple[int, int | None, str]:
    """How far the run is: (done, total or None, unit).

    Under a global sample budget, samples against the budget: the pushes it takes are not known
    beforehand (a partition's last mini-batch is short).  The last pushes may pass the budget by
    up to a mini-batch per worker (the summary counts them); the display stops at the budget.
    """
    budget = view.get("sample_budget")
    if budget:
        return min(view["samples_consumed"], budget), budget, "sample"
    pushes, planned = view["pushes"], view["planned_pushes"]
    return (min(pushes, planned) if planned else pushes), planned, "push"


class TrainingProgress:
    """Progress of one run, refreshed from ``ps.progress()`` on a background thread.

    It reads in-memory counters only: no Spark job runs for it.  ``stream`` defaults to stderr;
    ``interval_s`` is the bar's refresh period and ``log_interval_s`` the period of plain lines.
    """

    def __init__(self, ps: ProgressSource, description: str, interval_s: float = 0.5, *,
                 stream: TextIO | None = None, log_interval_s: float = 5.0) -> None:
        self._ps = ps
        self._description = description
        self._stream = stream if stream is not None else sys.stderr
        self._live = is_interactive(self._stream)
        self._interval = interval_s if self._live else log_interval_s
        self._started = time.monotonic()
        self._bar: Any = None
        if self._live:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=None, desc=description, unit="push", file=self._stream, dynamic_ncols=True,
                             leave=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-progress", daemon=True)

    def __enter__(self) -> TrainingProgress:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.refresh()                     # the final figures, as a bar or as the last line
        if self._bar is not None:
            self._bar.close()

    def refresh(self) -> None:
        """Show the current figures: redraw the bar, or write one plain line."""
        view = self._ps.progress()
        if self._bar is not None:
            self._refresh_bar(view)
        else:
            self._stream.write(self.line(view) + "\n")
            self._stream.flush()           # log collectors should see each line when it is written

    def line(self, view: dict[str, Any]) -> str:
        """One plain progress line (no carriage return) for ``view``."""
        done, total, unit = progress_count(view)
        share = f" ({100 * done // total}%)" if total else ""
        return (f"{self._description}: {done:,}{f'/{total:,}' if total else ''} {PLURAL[unit]}{share} "
                f"{format_fields(view)} elapsed={time.monotonic() - self._started:.0f}s")

    def _refresh_bar(self, view: dict[str, Any]) -> None:
        done, total, unit = progress_count(view)
        if total is not None and self._bar.total != total:
            self._bar.total = total
        self._bar.unit = unit
        self._bar.n = done
        self._bar.set_postfix_str(format_fields(view), refresh=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.refresh()
