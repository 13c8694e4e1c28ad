"""Batches copied to a CUDA device on a stream of their own, and the task's GPU made current (needs a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkdl._internal.data.cache import cache_partition
from sparkdl._internal.data.partitions import DeviceCopies, PartitionBatches
from sparkdl._internal.spark.devices import select_device
from tests.unit.data.test_partitions import all_batches, chunks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_host_batches_reach_the_device_whole_through_the_copy_stream(tmp_path):
    cuda = torch.device("cuda", 0)
    pieces, features, labels = chunks(40)
    cached = cache_partition(iter(pieces), "disk", "cross_entropy", cuda, budget=0, root=str(tmp_path))
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    batches = all_batches(PartitionBatches(cached.partition, cuda), order, 16)
    assert all(x.device == cuda and y.device == cuda for x, y in batches)
    np.testing.assert_array_equal(torch.cat([x for x, _ in batches]).cpu().numpy(), features[order.numpy()])
    np.testing.assert_array_equal(torch.cat([y for _, y in batches]).cpu().numpy(), labels[order.numpy()])
    cached.close()


def test_the_copy_runs_off_the_compute_stream_and_the_compute_stream_waits_for_it():
    from sparkdl._internal.data.block import Batch

    cuda = torch.device("cuda", 0)
    copies = DeviceCopies(cuda)
    assert copies.stream != torch.cuda.current_stream(cuda)
    host = Batch((torch.arange(1 << 20, dtype=torch.float32),), (None,), torch.arange(4), None)
    moved, copied = copies.send(host)
    batch = copies.receive(moved, copied)
    # what the compute stream computes after receive sees the copied values, whatever the host did meanwhile
    assert float(batch.inputs[0].sum()) == float(host.inputs[0].sum())
    assert batch.inputs[0].device == cuda and torch.equal(batch.labels.cpu(), host.labels)


def test_a_task_s_gpu_becomes_the_process_s_current_device():
    last, before = torch.cuda.device_count() - 1, torch.cuda.current_device()
    try:
        assert select_device("auto", [str(last)]) == torch.device("cuda", last)
        assert torch.cuda.current_device() == last
    finally:
        torch.cuda.set_device(before)
