"""The driver process is killed mid-run; a new run resumes from the newest checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkdl._internal.ps.server.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]



def train_command(digits: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", str(ROOT / "conf" / "digits_async.toml"),
            "--set", f"data.train='{digits / 'train.parquet'}'", "--set", f"data.test='{digits / 'test.parquet'}'",
            "--set", "train.policy='sync'", "--set", "train.epochs=6", "--output", str(output), *extra]


def whole_checkpoints(directory: Path) -> list[int]:
    """Versions of the checkpoints a file: URI holds whole: their manifest is written and names their length
    (a driver killed while writing a manifest leaves one that does not)."""
    versions = []
    for path in map(Path, list_checkpoints(directory)):
        try:
            manifest = json.loads(path.with_name(path.name + ".complete").read_text())
        except (OSError, ValueError):
            continue
        if manifest.get("bytes") == path.stat().st_size:
            versions.append(int(path.name[5:17]))
    return versions


def kill_and_resume(digits: Path, tmp_path: Path) -> tuple[int, subprocess.CompletedProcess, Path]:
    """Start the run, kill the whole driver (python + its JVM) once a mid-run checkpoint exists, and resume it
    from another working directory: the newest whole checkpoint's version, the resumed run, that directory."""
    checkpoints = tmp_path / "ckpt"
    # a URI, as a driver restarted on another host names a shared file system (hdfs:, s3a: ...)
    with_checkpoints = ("--set", f"train.checkpoint_dir='{checkpoints.as_uri()}'", "--set",
                        "train.checkpoint_every=50")
    driver = subprocess.Popen(train_command(digits, tmp_path / "killed", *with_checkpoints),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and driver.poll() is None:
            if any(version >= 100 for version in whole_checkpoints(checkpoints)):
                break
            time.sleep(0.05)
        assert driver.poll() is None, "the run finished before it could be interrupted"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=60)
    assert not (tmp_path / "killed" / "metrics.json").exists()
    saved = max(whole_checkpoints(checkpoints))
    elsewhere = tmp_path / "another-working-directory"
    elsewhere.mkdir()
    resumed = subprocess.run(train_command(digits, tmp_path / "resumed", *with_checkpoints,
                                           "--resume-from", checkpoints.as_uri()),
                             capture_output=True, text=True, timeout=600, cwd=elsewhere)
    return saved, resumed, elsewhere


def test_driver_restart_resumes_with_the_same_total_updates(tmp_path, digits_parquet):
    # the undisturbed reference runs alongside the run to be killed and the resumed one (its own driver and JVM)
    with open(tmp_path / "reference.log", "w") as reference_log:
        reference = subprocess.Popen(train_command(digits_parquet, tmp_path / "reference"),
                                     stdout=subprocess.DEVNULL, stderr=reference_log)
    try:
        saved, resumed, elsewhere = kill_and_resume(digits_parquet, tmp_path)
        reference.wait(timeout=600)
    finally:
        reference.kill()
    assert reference.returncode == 0, (tmp_path / "reference.log").read_text()[-3000:]
    expected = json.loads((tmp_path / "reference" / "metrics.json").read_text())
    assert 100 <= saved < expected["updates"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert metrics["resumed_from_version"] == saved
    assert metrics["version"] == metrics["updates"] == expected["updates"]
    assert metrics["test_accuracy"] >= expected["test_accuracy"] - 0.02
    assert not list(Path.cwd().glob("file:*")) and not list(elsewhere.glob("file:*"))   # no local copy of the URI
