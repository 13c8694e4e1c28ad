"""Live progress of a training run on the driver, drawn with tqdm from the PS's own counters."""
from __future__ import annotations

import math
import sys
import threading

from ..ps.transport import ParameterServer


class TrainingProgress:
    """A tqdm bar (terminal or notebook) refreshed from the parameter server twice a second.

    It reads in-memory counters only: no Spark job runs for it.
    """

    def __init__(self, ps: ParameterServer, description: str, interval_s: float = 0.5) -> None:
        from tqdm.auto import tqdm

        self._ps = ps
        self._interval = interval_s
        self._bar = tqdm(total=None, desc=description, unit="push", file=sys.stderr, dynamic_ncols=True,
                         leave=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-progress", daemon=True)

    def __enter__(self) -> "TrainingProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.refresh()
        self._bar.close()

    def refresh(self) -> None:
        view = self._ps.progress()
        if view["planned_pushes"] is not None and self._bar.total != view["planned_pushes"]:
            self._bar.total = view["planned_pushes"]
        self._bar.n = min(view["pushes"], self._bar.total or view["pushes"])
        rate = view["samples"] / view["window_s"] if view["window_s"] else float("nan")
        loss = view["loss"]
        self._bar.set_postfix_str(
            f"epoch={view['epoch'] + 1} v={view['version']} loss={'-' if math.isnan(loss) else f'{loss:.4f}'} "
            f"samples/s={'-' if math.isnan(rate) else f'{rate:,.0f}'} staleness={view['staleness']:.2f} "
            f"retries={view['retries']}", refresh=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.refresh()
