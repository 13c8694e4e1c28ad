"""Shards in memory and on disk, the prefetching loader, and the batch transforms."""
from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
import torch

from sparkdl._internal.data.block import RowBlock
from sparkdl._internal.data.cache import cache_partition
from sparkdl._internal.data.partitions import Partition, PartitionBatches, SpilledColumn, TensorColumn, batch_seed
from sparkdl._internal.data.rows import row_chunks
from sparkdl.transforms import Compose, DecodeImages, Normalize, RandomCrop, RandomHorizontalFlip, resolve_transform

CPU = torch.device("cpu")


def chunks(rows: int, width: int = 5, size: int = 7):
    generator = np.random.default_rng(0)
    features = generator.random((rows, width), dtype=np.float32)
    labels = np.arange(rows) % 3
    return [RowBlock((features[i:i + size],), labels[i:i + size]) for i in range(0, rows, size)], features, labels


def tensor_partition(x: torch.Tensor, y: torch.Tensor) -> Partition:
    return Partition((TensorColumn(x),), y)


def pairs(batches):
    """(features, labels) of every batch."""
    return [(b.inputs[0], b.labels) for b in batches]


def all_batches(data: PartitionBatches, order: torch.Tensor, batch_size: int, epoch: int | None = 0):
    indices = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    return pairs(data.batches(indices, epoch))


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_a_cached_shard_gives_the_rows_in_the_order_asked(tmp_path, mode):
    pieces, features, labels = chunks(40)
    cached = cache_partition(iter(pieces), mode, "cross_entropy", CPU, budget=0, root=str(tmp_path))
    assert cached.cache == mode and cached.partition.rows == 40 and cached.nbytes == features.nbytes
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    batches = all_batches(PartitionBatches(cached.partition, CPU), order, 16)
    assert [len(x) for x, _ in batches] == [16, 16, 8]
    np.testing.assert_array_equal(torch.cat([x for x, _ in batches]).numpy(), features[order.numpy()])
    np.testing.assert_array_equal(torch.cat([y for _, y in batches]).numpy(), labels[order.numpy()])
    assert torch.cat([y for _, y in batches]).dtype == torch.int64      # cross-entropy targets
    cached.close()
    assert os.listdir(tmp_path) == []


def test_auto_spills_once_the_shard_passes_the_budget_and_keeps_every_row(tmp_path):
    pieces, features, _ = chunks(100)
    small = cache_partition(iter(pieces), "auto", "mse", CPU, budget=features.nbytes, root=str(tmp_path))
    assert small.cache == "memory" and isinstance(small.partition.columns[0], TensorColumn)
    large = cache_partition(iter(pieces), "auto", "mse", CPU, budget=features.nbytes // 3, root=str(tmp_path))
    assert large.cache == "disk" and isinstance(large.partition.columns[0], SpilledColumn) and large.partition.rows == 100
    (x, y), = pairs([large.partition.gather(torch.arange(100))])
    np.testing.assert_array_equal(x.numpy(), features)
    assert y.dtype == torch.float32            # mse targets
    large.close()
    assert os.listdir(tmp_path) == []


def test_a_failing_partition_leaves_no_spill_files(tmp_path):
    pieces, _, _ = chunks(30)

    def broken():
        yield from pieces[:2]
        raise ValueError("row 14 of the partition has a NaN")

    with pytest.raises(ValueError, match="row 14"):
        cache_partition(broken(), "disk", "mse", CPU, budget=0, root=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_rows_of_another_shape_are_refused_while_spilling(tmp_path):
    first = RowBlock((np.zeros((3, 4), np.float32),), np.zeros(3))
    second = RowBlock((np.zeros((3, 5), np.float32),), np.zeros(3))
    with pytest.raises(ValueError, match="another shape"):
        cache_partition(iter([first, second]), "disk", "mse", CPU, budget=0, root=str(tmp_path))


def test_subsets_of_a_disk_shard_map_to_the_right_rows(tmp_path):
    pieces, features, _ = chunks(50)
    cached = cache_partition(iter(pieces), "disk", "mse", CPU, budget=0, root=str(tmp_path))
    rows = torch.tensor([3, 7, 11, 20, 41])
    inner = cached.partition.subset(rows).subset(torch.tensor([1, 4]))
    (x, _), = pairs([inner.gather(torch.tensor([1, 0]))])
    np.testing.assert_array_equal(x.numpy(), features[[41, 7]])


def png(value: int, size: int = 6) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((size, size), value, np.uint8), mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_encoded_rows_are_decoded_by_the_transform(tmp_path, mode):
    rows = [(png(10 * i), i) for i in range(20)]
    cached = cache_partition(row_chunks(rows, chunk_rows=6), mode, "cross_entropy", CPU, budget=0, root=str(tmp_path))
    assert cached.partition.rows == 20
    data = PartitionBatches(cached.partition, CPU, DecodeImages("L"))
    (x, y), = all_batches(data, torch.tensor([4, 0, 19]), 3)
    assert x.shape == (3, 1, 6, 6)
    torch.testing.assert_close(x[:, 0, 0, 0], torch.tensor([40, 0, 190]) / 255.0)
    assert y.tolist() == [4, 0, 19]
    with pytest.raises(ValueError, match="set batch_transform"):
        all_batches(PartitionBatches(cached.partition, CPU), torch.tensor([0]), 1)
    cached.close()


def test_the_transform_is_seeded_per_worker_epoch_and_step_and_off_without_an_epoch():
    seen = []

    def record(features, generator):
        seen.append(None if generator is None else generator.initial_seed())
        return features

    data = PartitionBatches(tensor_partition(torch.zeros(8, 2), torch.zeros(8)), CPU, record, seed=5, worker=1)
    all_batches(data, torch.arange(8), 4, epoch=2)
    all_batches(data, torch.arange(8), 4, epoch=None)
    assert seen == [batch_seed(5, 1, 2, 0), batch_seed(5, 1, 2, 1), None, None]
    assert len({batch_seed(5, w, e, s) for w in range(3) for e in range(3) for s in range(3)}) == 27


def test_a_transform_error_reaches_the_training_loop_and_the_loader_thread_ends():
    def failing(features, generator):
        raise RuntimeError("cannot decode row")

    before = threading.active_count()
    data = PartitionBatches(tensor_partition(torch.zeros(8, 2), torch.zeros(8)), CPU, failing)
    with pytest.raises(RuntimeError, match="cannot decode row"):
        all_batches(data, torch.arange(8), 2)
    # leaving an epoch early stops its loader too
    slow = PartitionBatches(tensor_partition(torch.zeros(8, 2), torch.zeros(8)), CPU, lambda features, generator: features)
    batches = slow.batches([torch.arange(2)] * 50, None)
    next(batches)
    assert threading.active_count() == before + 1
    batches.close()
    assert threading.active_count() == before


def test_random_crop_shifts_reproducibly_and_takes_the_centre_when_scoring():
    images = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 4, 4)
    crop = RandomCrop(padding=1)
    first = crop(images, torch.Generator().manual_seed(3))
    again = crop(images, torch.Generator().manual_seed(3))
    assert first.shape == images.shape and torch.equal(first, again)
    assert not all(torch.equal(crop(images, torch.Generator().manual_seed(s)), images) for s in range(10))
    assert torch.equal(crop(images, None), images)
    assert RandomCrop(2)(images, None).shape == (2, 1, 2, 2)


def test_flip_normalize_compose_and_references():
    images = torch.arange(8, dtype=torch.float32).reshape(2, 1, 2, 2)
    flip = RandomHorizontalFlip(p=1.0)
    assert torch.equal(flip(images, torch.Generator()), images.flip(-1))
    assert torch.equal(flip(images, None), images)
    pipeline = Compose(Normalize([1.0], [2.0]), flip)
    assert torch.equal(pipeline(images, None), (images - 1) / 2)
    assert resolve_transform("sparkdl.transforms:shifted_grayscale") is not None
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_transform("sparkdl.transforms:no_such_thing")


def test_labels_with_several_values_keep_their_shape_on_disk(tmp_path):
    features = np.arange(12, dtype=np.float32).reshape(6, 2)
    labels = np.arange(12, dtype=np.float32).reshape(6, 2) * 10
    pieces = [RowBlock((features[:4],), labels[:4]), RowBlock((features[4:],), labels[4:])]
    on_disk = cache_partition(iter(pieces), "disk", "mse", CPU, budget=0, root=str(tmp_path))
    in_memory = cache_partition(iter(pieces), "memory", "mse", CPU, budget=0, root=str(tmp_path))
    index = torch.tensor([5, 1, 3])
    for cached in (on_disk, in_memory):
        (x, y), = pairs([cached.partition.gather(index)])
        np.testing.assert_array_equal(x.numpy(), features[[5, 1, 3]])
        np.testing.assert_array_equal(y.numpy(), labels[[5, 1, 3]])


def test_a_device_shard_subset_is_an_index_not_a_copy():
    partition = tensor_partition(torch.arange(10.0).reshape(5, 2), torch.arange(5))
    part = partition.subset(torch.tensor([1, 3, 4])).subset(torch.tensor([2, 0]))
    assert part.columns[0].values.data_ptr() == partition.columns[0].values.data_ptr() and part.rows == 2
    (x, y), = pairs([part.gather(torch.tensor([0, 1]))])
    assert y.tolist() == [4, 1] and x[:, 0].tolist() == [8.0, 2.0]


def test_spilling_arrow_batches_holds_no_earlier_batch_while_the_next_is_read(tmp_path):
    """A DataFrame's partition spilled to disk keeps at most the batch being written: while Spark's next Arrow
    batch is read, no earlier batch (nor a block sharing its buffers) is alive, whatever the partition's size."""
    import pyarrow as pa

    from sparkdl._internal.data.arrow import arrow_chunks
    from sparkdl._internal.data.columns import ColumnSpec

    rows, width, batches = 1_000, 784, 6
    batch_bytes = rows * width * 4
    generator = np.random.default_rng(0)
    allocated_while_reading: list[int] = []

    def spark_batch() -> pa.RecordBatch:
        values = generator.random(rows * width, dtype=np.float32)
        # in Arrow's memory pool, as a batch read from Spark's stream is (pa.array alone would wrap numpy's)
        flat = pa.concat_arrays([pa.array(values[:rows * width // 2]), pa.array(values[rows * width // 2:])])
        features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32)), flat)
        labels = pa.concat_arrays([pa.array(generator.integers(0, 10, rows))])
        return pa.RecordBatch.from_arrays([features, labels], ["features", "label"])

    def spark_batches():      # like Spark's reader: keeps no reference to a batch once handed on
        for _ in range(batches):
            allocated_while_reading.append(pa.total_allocated_bytes())
            yield spark_batch()

    baseline = pa.total_allocated_bytes()
    cached = cache_partition(arrow_chunks(spark_batches(), ColumnSpec()), "disk", torch.nn.CrossEntropyLoss(),
                             CPU, 0, root=str(tmp_path))
    assert cached.cache == "disk" and cached.partition.rows == rows * batches
    held = [allocated - baseline for allocated in allocated_while_reading]
    assert max(held) < batch_bytes / 2, (held, batch_bytes)
    cached.close()
