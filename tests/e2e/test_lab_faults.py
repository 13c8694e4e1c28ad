"""The driver host's link cut, on the multi-host lab: part of CI's lab leg (``make test-lab``).

Alone (about 2 min)::

    python -m pytest -q -m lab tests/e2e/test_lab_faults.py
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from sparkdl._internal.ps.server.checkpoint import load_latest_checkpoint

from . import lab_run
from .test_lab import SCRIPT, built_lab

pytestmark = [pytest.mark.lab, pytest.mark.e2e, pytest.mark.slow]


def executor_logs(lab_logs: Path) -> str:
    """Every executor's stderr under the worker hosts' work directories."""
    return "\n".join(p.read_text(errors="replace") for p in sorted(lab_logs.glob("*-work/app-*/*/stderr")))


def test_the_drivers_cut_link_ends_the_workers_and_the_run_with_the_checkpoint_intact(tmp_path):
    """Async on two worker hosts; the driver host's link (the PS, the master) is cut mid-run and
    stays down.  Each worker's next push waits ``timeout_s`` for the PS and gives up; the PS, hearing
    nothing from anyone, ends the run with an error that points at the driver's own link (measured:
    34 s after the cut); the checkpoint written before loads."""
    timeout_s = 20.0
    checkpoints = tmp_path / "checkpoints"
    settings = {"policy": "async", "epochs": 200, "timeout_s": timeout_s, "checkpoint_dir": str(checkpoints),
                "checkpoint_every": 50}
    params = sum(p.numel() for p in lab_run.digits_mlp().parameters())
    with built_lab(workers=2, rate="1gbit", worker_timeout_s=15) as lab:
        log = tmp_path / "driver.log"
        driver = lab.start_driver([sys.executable, str(SCRIPT), "--master", lab.master_url, "--driver-host",
                                   lab.driver.address, "--settings", json.dumps(settings), "--weights",
                                   str(tmp_path / "lab.pt")], log)
        try:
            deadline = time.monotonic() + 300
            while lab.link_bytes(lab.workers[1])["sent"] < 100 * params * 4 and driver.poll() is None:
                assert time.monotonic() < deadline, "the run never got going"
                time.sleep(0.1)
            assert driver.poll() is None, log.read_text()[-3000:]
            lab.cut(lab.driver)
            cut = time.monotonic()
            try:
                driver.wait(timeout=timeout_s + 120)
            except Exception:
                pytest.fail("the driver hung after its link was cut: " + log.read_text()[-6000:])
            ended_after = time.monotonic() - cut
            # the workers gave up on the PS too (their executors cannot report it to the cut driver)
            deadline = time.monotonic() + timeout_s + 30
            while "PSTimeoutError" not in executor_logs(lab.logs) and time.monotonic() < deadline:
                time.sleep(1)
            workers_said = executor_logs(lab.logs)
        finally:
            lab.mend(lab.driver)
            if driver.poll() is None:
                driver.kill()
    output = log.read_text()
    print(f"the driver ended {ended_after:.1f} s after the cut\n{output[-3000:]}")
    assert driver.returncode != 0
    assert ended_after <= timeout_s + 30 + 2 * lab.worker_timeout_s, ended_after
    assert workers_said.count("PSTimeoutError") >= 1, workers_said[-3000:]
    # the error says what the driver could see: every worker silent, no executor left, its own link suspect
    error = output[output.rfind("sparkdl.errors."):]
    assert error.startswith("sparkdl.errors.ClusterConfigError: the training stage cannot be retried"), output[-3000:]
    assert "worker 0 sent nothing" in error and "worker 1 sent nothing" in error, error
    assert "the driver's own network link" in error, error
    state = load_latest_checkpoint(checkpoints)
    assert state is not None and state["version"] >= 50
