"""Checkpoints on Hadoop-compatible URIs through the driver's FileSystem API (file: here; hdfs:, s3a: ... the same path)."""
from __future__ import annotations

import pytest
import torch

from sparkdl import ClusterConfigError, TrainConfig, train
from sparkdl._internal.spark.hadoop_files import MANIFEST, HadoopCheckpoints, HadoopFiles

from ..conftest import DIGITS_MLP

SYNC = TrainConfig(num_workers=2, epochs=2, batch_size=32, learning_rate=0.05, momentum=0.9, policy="sync", seed=5)


def test_a_file_uri_is_written_where_it_points_and_resumed_from_another_working_directory(
        digits_rdd, tmp_path, monkeypatch):
    folder = tmp_path / "ck"
    monkeypatch.chdir(tmp_path)
    first = train(digits_rdd, DIGITS_MLP, SYNC.replace(checkpoint_dir=folder.as_uri(), checkpoint_every=20,
                                                       checkpoint_keep=2))
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    last = f"ckpt-{first.summary['version']:012d}.pt"
    # the newest two, each with its manifest; nothing under a directory named after the URI
    assert last in names and last + MANIFEST in names and len([n for n in names if n.endswith(".pt")]) == 2
    assert not list(tmp_path.glob("file:*"))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)     # a driver restarted elsewhere names the same URI
    resumed = train(digits_rdd, DIGITS_MLP, SYNC.replace(epochs=3, resume_from=folder.as_uri()))
    assert resumed.summary["resumed_from_version"] == first.summary["version"]
    assert resumed.summary["version"] == resumed.summary["updates"] > first.summary["version"]


def test_a_uri_the_session_cannot_reach_is_refused_before_launch_naming_the_setting(digits_rdd, spark):
    jobs_before = len(spark.sparkContext.statusTracker().getJobIdsForGroup())
    with pytest.raises(ClusterConfigError, match="checkpoint_dir='nosuchfs://bucket/run' cannot be reached"):
        train(digits_rdd, DIGITS_MLP, SYNC.replace(checkpoint_dir="nosuchfs://bucket/run"))
    with pytest.raises(ClusterConfigError, match="resume_from='nosuchfs://bucket/run' cannot be reached"):
        train(digits_rdd, DIGITS_MLP, SYNC.replace(resume_from="nosuchfs://bucket/run"))
    assert len(spark.sparkContext.statusTracker().getJobIdsForGroup()) == jobs_before


def test_only_checkpoints_with_their_manifest_count_and_removal_starts_with_the_manifest(spark, tmp_path):
    store = HadoopCheckpoints(HadoopFiles(spark))
    directory = (tmp_path / "store").as_uri()
    store.publish(directory, "ckpt-000000000001.pt", {"version": 1, "weights": torch.ones(3)})
    store.publish(directory, "ckpt-000000000002.pt", {"version": 2, "weights": torch.ones(3)})
    # a crash after the file and before its manifest, and a file cut short after its manifest
    store.files.write(f"{directory}/ckpt-000000000003.pt", b"\x80\x02 half")
    whole = store.files.read(f"{directory}/ckpt-000000000002.pt")
    store.files.write(f"{directory}/ckpt-000000000004.pt", whole[: len(whole) // 2])
    store.files.write(f"{directory}/ckpt-000000000004.pt{MANIFEST}", f'{{"bytes": {len(whole)}}}'.encode())
    assert store.complete(directory) == ["ckpt-000000000001.pt", "ckpt-000000000002.pt"]
    assert store.read(directory, "ckpt-000000000002.pt")["version"] == 2
    store.remove(directory, "ckpt-000000000001.pt")
    assert store.complete(directory) == ["ckpt-000000000002.pt"]
    assert not (tmp_path / "store" / f"ckpt-000000000001.pt{MANIFEST}").exists()
