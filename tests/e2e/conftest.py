"""Fixtures of the end-to-end tests."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def digits_parquet(tmp_path_factory):
    """scikit-learn digits written by jobs/prepare_data.py (train/test Parquet)."""
    out = tmp_path_factory.mktemp("data")
    subprocess.run([sys.executable, str(ROOT / "jobs" / "prepare_data.py"), "--output", str(out),
                    "--datasets", "digits"], check=True, timeout=300)
    return out / "digits"
