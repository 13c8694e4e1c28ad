"""The driver's progress display: plain lines for logs, a tqdm bar for terminals and notebooks."""
from __future__ import annotations

import io
import threading
import time

import pytest

from sparkdl._internal.modes import progress as progress_module
from sparkdl._internal.modes.progress import TrainingProgress
from sparkdl._internal.ps.server.run_progress import run_progress


class FakeRun:
    """A progress source shaped like ``sparkdl._internal.ps.server.run_progress.run_progress``; each call advances the run by 5 pushes."""

    def __init__(self, planned: int = 40) -> None:
        self.planned = planned
        self.pushes = 0
        self.finished = False
        self.lock = threading.Lock()

    def progress(self) -> dict:
        with self.lock:
            self.pushes = self.planned if self.finished else min(self.pushes + 5, self.planned - 5)
            return {"pushes": self.pushes, "planned_pushes": self.planned, "version": self.pushes,
                    "epoch": self.pushes // 20, "loss": 1.0 / self.pushes, "samples": 1600, "window_s": 0.5,
                    "staleness": 0.25, "retries": 1}


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_stream_gets_plain_lines_every_interval_and_at_the_end():
    stream, run = io.StringIO(), FakeRun()
    with TrainingProgress(run, "sparkdl async x2", stream=stream, log_interval_s=0.05):
        deadline = time.monotonic() + 30
        while stream.getvalue().count("\n") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        run.finished = True
    text = stream.getvalue()
    assert "\r" not in text                     # no redrawn bar piling up on one log line
    lines = text.splitlines()
    assert len(lines) >= 4, text                # periodic lines, plus the final one
    for line in lines:
        assert line.startswith("sparkdl async x2: ") and " pushes (" in line
        for field in ("epoch=", "v=", "loss=", "samples/s=3,200", "staleness=0.25", "retries=1", "elapsed="):
            assert field in line, (field, line)
    assert lines[-1].startswith("sparkdl async x2: 40/40 pushes (100%) epoch=3 v=40 loss=0.0250")


def test_the_final_line_is_written_even_for_a_short_run():
    stream = io.StringIO()
    with TrainingProgress(FakeRun(), "sparkdl sync x2", stream=stream, log_interval_s=60):
        pass
    assert "\r" not in stream.getvalue() and stream.getvalue().count("\n") == 1
    assert stream.getvalue().startswith("sparkdl sync x2: 5/40 pushes (12%) epoch=1")


def test_unknown_plan_and_no_rate_yet_are_shown_as_such():
    class Starting:
        def progress(self) -> dict:
            return {"pushes": 0, "planned_pushes": None, "version": 0, "epoch": 0, "loss": float("nan"),
                    "samples": 0, "window_s": None, "staleness": 0.0, "retries": 0}

    stream = io.StringIO()
    with TrainingProgress(Starting(), "run", stream=stream, log_interval_s=60):
        pass
    assert stream.getvalue().startswith("run: 0 pushes epoch=1 v=0 loss=- samples/s=- staleness=0.00 retries=0")


def test_a_terminal_keeps_the_redrawn_bar():
    stream, run = TerminalStream(), FakeRun()
    with TrainingProgress(run, "sparkdl async x2", interval_s=0.05, stream=stream):
        time.sleep(0.2)
        run.finished = True
    text = stream.getvalue()
    assert text.count("\r") >= 2 and "samples/s=3,200" in text and "40/40" in text


@pytest.mark.parametrize("notebook, interactive", [(True, True), (False, False)])
def test_a_notebook_counts_as_interactive(monkeypatch, notebook, interactive):
    monkeypatch.setattr(progress_module, "in_notebook", lambda: notebook)
    assert progress_module.is_interactive(io.StringIO()) is interactive
    assert progress_module.is_interactive(TerminalStream()) is True


def test_the_line_shows_the_validation_loss_once_there_is_one():
    view = {"pushes": 5, "planned_pushes": 10, "version": 5, "epoch": 1, "loss": 0.5, "samples": 100,
            "window_s": 1.0, "staleness": 0.0, "retries": 0}
    assert "val_loss" not in progress_module.format_fields(view)
    assert "val_loss=0.2500" in progress_module.format_fields({**view, "val_loss": 0.25})


def test_under_a_global_budget_the_line_counts_samples_against_it_and_the_runs_epoch():
    import torch

    from sparkdl._internal.ps.server.core import PSCore, PushMeta
    from sparkdl.config import TrainConfig

    # 2 workers x 60 rows, 2 epochs of batch 32: a budget of 240 samples; a partition's last batch is short,
    # so no one knows beforehand how many pushes it takes
    core = PSCore(TrainConfig(num_workers=2, policy="async", epochs=2, batch_size=32, learning_rate=0.1),
                  torch.zeros(4))
    tokens = [core.hello(worker, 0, 60) for worker in range(2)]
    line = TrainingProgress(core, "run", stream=io.StringIO()).line

    def push(worker: int, epoch: int) -> None:
        assert core.push(worker, tokens[worker], PushMeta(core.version, 32, 1.0, epoch), torch.ones(4), True).accepted

    for epoch in (0, 0, 1, 1, 2):        # the fast worker 0 starts a third pass over its partition
        push(0, epoch)
    assert line(run_progress(core)).startswith("run: 160/240 samples (66%) epoch=2 ")
    for _ in range(3):                   # the last push passes the budget by 16 samples
        push(1, 0)
    assert core.members.budget_spent and core.members.samples_consumed == 256
    assert line(run_progress(core)).startswith("run: 240/240 samples (100%) epoch=2 ")
