"""Typed multi-input batches: dtypes kept, ragged rows padded per mini-batch, inputs mapped onto forward, weights."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from sparkdl._internal.data.arrow import arrow_chunks, arrow_to_block
from sparkdl._internal.data.block import Ragged, RowBlock
from sparkdl._internal.data.cache import cache_partition
from sparkdl._internal.data.checks import DataRules
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl._internal.data.partitions import Padding, PartitionBatches
from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.training.inputs import ModelCall
from sparkdl._internal.training.losses import resolve_loss
from sparkdl.errors import DataError

CPU = torch.device("cpu")
SPEC = ColumnSpec(input_cols=("user", "ids", "dense", "flag"), label_col="label", weight_col="w")
#: token ids of varying length; the longest (7) is row 4
IDS = [[1, 2], [3], [4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14, 15], [16]]


def arrow_rows(users=(0, 1, 2**31 - 1, 2**40, 5, 6)) -> pa.RecordBatch:
    n = len(IDS)
    return pa.RecordBatch.from_pydict({
        "user": pa.array(list(users), pa.int64()),
        "ids": pa.array(IDS, pa.list_(pa.int32())),
        "dense": pa.array([[float(i), 0.5] for i in range(n)], pa.list_(pa.float64())),
        "flag": pa.array([i % 2 == 0 for i in range(n)]),
        "label": pa.array([float(i) for i in range(n)]),
        "w": pa.array([1.0, 2.0, 0.0, 1.0, 1.0, 3.0]),
    })


def test_each_input_keeps_its_dtype_and_ids_reach_the_model_exactly():
    block = arrow_to_block([arrow_rows()], SPEC, DataRules())
    user, ids, dense, flag = block.inputs
    assert user.dtype == np.int64 and user.tolist() == [0, 1, 2**31 - 1, 2**40, 5, 6]
    assert isinstance(ids, Ragged) and ids.dtype == np.int64 and ids.lengths.tolist() == [2, 1, 3, 2, 7, 1]
    assert isinstance(dense, Ragged) and dense.dtype == np.float32
    assert flag.dtype == np.bool_
    assert block.weights.dtype == np.float32 and block.weights.tolist() == [1.0, 2.0, 0.0, 1.0, 1.0, 3.0]
    shaped = arrow_to_block([arrow_rows()], ColumnSpec(input_cols=("dense",), input_shapes=((2, 1),), label_col=None))
    assert shaped.inputs[0].shape == (6, 2, 1) and shaped.inputs[0].dtype == np.float32


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_ragged_rows_are_padded_to_the_longest_row_of_each_batch_with_their_mask(tmp_path, mode):
    blocks = list(arrow_chunks([arrow_rows().slice(0, 3), arrow_rows().slice(3)], SPEC, DataRules()))
    cached = cache_partition(iter(blocks), mode, "mse", CPU, budget=0, root=str(tmp_path))
    assert cached.cache == mode and cached.partition.rows == 6
    data = PartitionBatches(cached.partition, CPU, padding=Padding(-1))
    short, long = data.batches([torch.tensor([2, 0, 1]), torch.tensor([4, 5])], epoch=0)
    user, ids, _, flag = short.inputs
    assert user.dtype == torch.int64 and user.tolist() == [2**31 - 1, 0, 1]
    # padded to this batch's longest row (3), not the partition's (7)
    assert ids.tolist() == [[4, 5, 6], [1, 2, -1], [3, -1, -1]] and ids.dtype == torch.int64
    assert short.masks[1].tolist() == [[True, True, True], [True, True, False], [True, False, False]]
    assert short.masks[0] is None and flag.dtype == torch.bool
    assert long.inputs[1].shape == (2, 7) and long.inputs[1][1].tolist() == [16] + [-1] * 6
    assert short.weights.tolist() == [0.0, 1.0, 2.0] and short.weight_sum == 3.0
    fixed = PartitionBatches(cached.partition, CPU, padding=Padding(0, length=8))
    assert next(fixed.batches([torch.tensor([1])], epoch=0)).inputs[1].tolist() == [[3] + [0] * 7]
    cached.close()


def test_a_subset_of_ragged_rows_and_a_block_take_keep_each_rows_elements():
    ragged = Ragged(np.arange(10, dtype=np.int64), np.array([0, 2, 3, 6, 10]))
    taken = ragged.take(np.array([3, 0]))
    assert taken.offsets.tolist() == [0, 4, 6] and taken.values.tolist() == [6, 7, 8, 9, 0, 1]
    joined = Ragged.concat([taken, ragged])
    assert len(joined) == 6 and joined.values[6:].tolist() == list(range(10))


def test_rows_that_no_update_may_see_are_refused_with_their_row_and_column():
    with pytest.raises(DataError, match=r"row 1 of the partition has the id -3 in column 'user'.*StringIndexer"):
        arrow_to_block([arrow_rows(users=(0, -3, 1, 2, 3, 4))], SPEC, DataRules())
    with pytest.raises(DataError, match=r"row 4 .* 7 elements in column 'ids', more than sequence_length=5"):
        arrow_to_block([arrow_rows()], SPEC, DataRules(max_length=5))
    bad = arrow_rows().set_column(5, "w", pa.array([1.0, 1.0, -1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(DataError, match=r"row 2 .* weight -1 in column 'w'"):
        arrow_to_block([bad], SPEC, DataRules())
    nan = arrow_rows().set_column(2, "dense", pa.array([[0.0, 0.0]] * 5 + [[float("nan"), 1.0]]))
    with pytest.raises(DataError, match=r"row 5 .* NaN or infinite values .* column 'dense'"):
        arrow_to_block([nan], SPEC, DataRules())


def test_rdd_rows_of_several_inputs_become_typed_fields():
    rows = [((7, [1, 2, 3], 0.5), 1.0, 2.0), ((2**35, [4], 1.5), 0.0, 1.0)]
    block, = row_chunks(rows)
    user, ids, number = block.inputs
    assert user.dtype == np.int64 and user.tolist() == [7, 2**35]
    assert isinstance(ids, Ragged) and ids.values.tolist() == [1, 2, 3, 4]
    assert number.dtype == np.float32 and block.weights.tolist() == [2.0, 1.0]
    with pytest.raises(DataError, match="row 1 of the partition has the id -1 in column 'input 0'"):
        list(row_chunks([((1, [1]), 0.0), ((-1, [2]), 0.0)]))


class TwoInputs(nn.Module):
    """forward(ids, numeric) with the ids' padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 3)
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, ids: torch.Tensor, numeric: torch.Tensor, ids_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.seen = {"ids": ids, "numeric": numeric, **({"ids_mask": ids_mask} if ids_mask is not None else {})}
        vectors = self.embedding(ids) * (ids_mask.unsqueeze(-1) if ids_mask is not None else 1)
        return vectors.sum(dim=1)[:, :1] + numeric[:, None]


def test_inputs_reach_forward_by_position_or_by_name_with_the_mask_where_forward_takes_it():
    model = TwoInputs()
    ids, numeric = torch.tensor([[1, 2], [3, 0]]), torch.tensor([0.5, 1.5])
    mask = torch.tensor([[True, True], [True, False]])
    ModelCall.for_module(model)(model, (ids, numeric), (mask, None))
    assert set(model.seen) == {"ids", "numeric"}          # positional: no mask
    call = ModelCall.for_module(model, ("ids", "numeric"))
    assert call.mask_args == ("ids_mask", None)
    call(model, (ids, numeric), (mask, None))
    assert torch.equal(model.seen["ids_mask"], mask) and torch.equal(model.seen["numeric"], numeric)
    swapped = ModelCall.for_module(model, ("numeric", "ids"))    # the names, not the order, decide
    swapped(model, (numeric, ids), (None, mask))
    assert torch.equal(model.seen["ids"], ids) and "ids_mask" in model.seen


def test_a_named_loss_with_weights_is_the_weighted_mean_of_the_rows_losses():
    output, target = torch.tensor([[0.0], [1.0], [3.0]]), torch.tensor([1.0, 1.0, 1.0])
    weight = torch.tensor([1.0, 0.0, 3.0])
    mse = resolve_loss("mse")
    assert mse(output, target, None).item() == pytest.approx((1 + 0 + 4) / 3)
    assert mse(output, target, weight).item() == pytest.approx((1 * 1 + 3 * 4) / 4)
    # multi-output: each row's mean over its outputs, then weighted
    wide = resolve_loss("mse")(torch.zeros(2, 2), torch.tensor([[1.0, 3.0], [2.0, 2.0]]), torch.tensor([1.0, 1.0]))
    assert wide.item() == pytest.approx((5 + 4) / 2)

    def users(output, target, weight=None):
        return ((output.squeeze(1) - target) ** 2 * (1 if weight is None else weight)).sum()

    assert resolve_loss(users)(output, target, weight).item() == pytest.approx(13.0)


def test_weighted_rows_and_unweighted_rows_give_the_same_step_when_the_weights_repeat_rows():
    """Weight 2 on a row trains like that row twice: Σ w·ℓ / Σ w."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(4, 3), torch.randn(4)
    loss = resolve_loss("mse")
    weighted = loss(model(x), y, torch.tensor([2.0, 1.0, 1.0, 1.0]))
    repeated = loss(model(torch.cat([x[:1], x])), torch.cat([y[:1], y]), None)
    torch.testing.assert_close(weighted, repeated)


def test_blocks_of_another_kind_are_refused_while_spilling(tmp_path):
    ints = RowBlock((np.zeros(3, np.int64),), np.zeros(3))
    floats = RowBlock((np.zeros(3, np.float32),), np.zeros(3))
    with pytest.raises(DataError, match="another shape, dtype or kind"):
        cache_partition(iter([ints, floats]), "disk", "mse", CPU, budget=0, root=str(tmp_path))


def test_a_transform_of_several_inputs_receives_their_tuple_and_the_masks_pass_through(tmp_path):
    seen = []

    def scale_numbers(inputs, generator):
        seen.append(tuple(type(v).__name__ for v in inputs))
        user, ids, dense, flag = inputs
        return user, ids, dense * 2, flag

    block = arrow_to_block([arrow_rows()], SPEC, DataRules())
    cached = cache_partition(iter([block]), "memory", "mse", CPU, budget=0, root=str(tmp_path))
    batch = next(PartitionBatches(cached.partition, CPU, scale_numbers).batches([torch.tensor([2, 1])], epoch=0))
    assert seen == [("Tensor",) * 4]
    assert batch.inputs[2].tolist() == [[4.0, 1.0], [2.0, 1.0]] and batch.masks[1].tolist() == [[True, True, True],
                                                                                               [True, False, False]]
    with pytest.raises(TypeError, match="a torch.Tensor or a tuple of them"):
        next(PartitionBatches(cached.partition, CPU, lambda inputs, g: "text").batches([torch.tensor([0])], epoch=0))


def test_empty_sequences_keep_the_ids_dtype_and_rdd_rows_obey_the_sequence_bound():
    block, = row_chunks([(([1, 2, 3],), 0), (([],), 1)])
    assert block.inputs[0].dtype == np.int64 and block.inputs[0].lengths.tolist() == [3, 0]
    only_empty, = row_chunks([(([],), 0)])
    assert only_empty.inputs[0].dtype == np.int64
    with pytest.raises(DataError, match="row 1 .* 4 elements in column 'input 0', more than sequence_length=3"):
        list(row_chunks([(([1],), 0), (([1, 2, 3, 4],), 1)], rules=DataRules(max_length=3)))


def test_a_multi_label_model_scores_a_vector_of_labels_and_of_probabilities():
    from sparkdl.ml._outputs import OutputSpec
    from sparkdl.ml._scoring import predict_arrays

    class TwoLogits(nn.Module):
        def forward(self, x):
            return torch.stack([x * 10, -x * 10], dim=1)

    block = RowBlock((np.array([1.0, -1.0, 2.0], np.float32),))
    labels = predict_arrays(TwoLogits(), CPU, block, OutputSpec("multilabel", "prediction", "probability"), 2)
    assert labels["prediction"].tolist() == [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    assert labels["probability"].shape == (3, 2) and labels["probability"][1, 1] > 0.99
    outputs = predict_arrays(TwoLogits(), CPU, block, OutputSpec("multioutput", "prediction", "probability"), 2)
    assert outputs["prediction"].tolist() == [[10.0, -10.0], [-10.0, 10.0], [20.0, -20.0]]
    assert list(outputs) == ["prediction"]


def test_arrow_numbers_and_booleans_read_as_pyarrow_reads_them_and_without_pandas(tmp_path):
    from sparkdl._internal.data.arrow import _numbers

    flags = pa.array([bool(i % 3) for i in range(37)])
    for offset in range(10):           # a slice starts inside a byte of the bit-packed buffer
        for length in (0, 1, 9, 37 - offset):
            sliced = flags.slice(offset, length)
            assert np.array_equal(_numbers(sliced), sliced.to_numpy(zero_copy_only=False))
            assert _numbers(sliced).dtype == np.bool_
    for kind in (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
                 pa.float16(), pa.float32(), pa.float64()):   # every fixed-width number, as pyarrow reads it
        numbers = pa.array(np.arange(5).astype(kind.to_pandas_dtype()), type=kind).slice(1)
        assert _numbers(numbers).dtype == kind.to_pandas_dtype() and np.array_equal(_numbers(numbers), [1, 2, 3, 4])
    masked = pa.array([1.0, None, 3.0] * 5).slice(2)
    assert np.array_equal(_numbers(masked.is_null()), masked.is_null().to_numpy(zero_copy_only=False))
    # a fresh interpreter converting batches that arrive as Spark sends them (an Arrow stream) of every kind,
    # and their null masks, never imports pandas
    stream = tmp_path / "batch.arrows"
    with pa.ipc.new_stream(str(stream), arrow_rows().schema) as writer:
        writer.write_batch(arrow_rows())
    code = ("import sys\n"
            "import pyarrow as pa\n"
            "from sparkdl._internal.data.arrow import arrow_to_block, null_feature_rows\n"
            "from sparkdl._internal.data.checks import DataRules\n"
            "from sparkdl._internal.data.columns import ColumnSpec\n"
            f"batch = pa.ipc.open_stream({str(stream)!r}).read_next_batch()\n"
            f"spec = ColumnSpec(input_cols={SPEC.input_cols!r}, label_col='label', weight_col='w')\n"
            "block = arrow_to_block([batch.slice(1)], spec, DataRules())\n"
            "print(block.inputs[3].tolist())\n"
            "assert not null_feature_rows(batch, spec).any()\n"
            "sys.exit(3 if 'pandas' in sys.modules else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    flag = arrow_rows().column(3).to_pylist()[1:]
    assert done.stdout.split("\n")[-2] == str(flag)
