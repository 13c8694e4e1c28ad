"""The job files' inputs: a missing data set is named with the command that prepares it, before Spark starts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "jobs"))

import prepare_data  # noqa: E402
import train  # noqa: E402

JOB_FILES = sorted((ROOT / "conf").glob("*.toml"))


@pytest.mark.parametrize("job_file", JOB_FILES, ids=lambda p: p.stem)
def test_every_job_files_data_is_a_data_set_the_prepare_script_writes(job_file):
    job = train.load_job_config(job_file, [])
    for role in ("train", "test"):
        assert Path(job["data"][role]).parent.name in prepare_data.DATASETS


def test_a_job_whose_data_is_not_prepared_says_which_data_set_to_prepare(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                      # no data/ here
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", str(ROOT / "conf" / "mnist_png_cnn.toml"), "--output", str(tmp_path / "run")])
    message = str(stopped.value)
    assert "data/mnist_png/train.parquet does not exist" in message
    assert "python jobs/prepare_data.py --datasets mnist_png" in message
