"""TorchModel.transform's executor side on Arrow batches: invalid rows under each handleInvalid."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from sparkdl import DataError
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl.ml._outputs import OutputSpec
from sparkdl.ml._persistence import state_to_bytes
from sparkdl.ml._scoring import ScoringSpec, make_scorer
from tests.unit.conftest import refused_under_headroom


class BytesBackend:
    """What a Spark Connect session does with a scoring spec: the bytes travel as they are."""

    session = None

    def share(self, data: bytes) -> bytes:
        return data


def net(outputs: int):
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(3, outputs)
    return build


def score(batches: list[pa.RecordBatch], handle_invalid: str, outputs: int = 4, task: str = "multiclass",
          columns: ColumnSpec | None = None) -> list[pa.RecordBatch]:
    spec = ScoringSpec(net(outputs), state_to_bytes(net(outputs)().state_dict()),
                       columns or ColumnSpec(label_col=None), OutputSpec(task, "prediction", "probability"), "cpu", 16,
                       handle_invalid=handle_invalid)
    return list(make_scorer(spec, BytesBackend())(iter(batches)))


def batch(rows: list) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array(rows, pa.list_(pa.float64()))], names=["features"])


GOOD = [0.1, 0.2, 0.3]
NAN = [float("nan"), 0.2, 0.3]


def test_the_error_names_the_row_of_the_partition_across_batches():
    with pytest.raises(DataError, match=r"row 5 of the partition has null, NaN or infinite \(as float32\) features "
                                         r"in 'features' \(2 such rows"):
        score([batch([GOOD] * 3), batch([GOOD]), batch([GOOD, NAN, None])], "error")


@pytest.mark.parametrize("task, outputs", [("multiclass", 4), ("binary", 1), ("regression", 1)])
def test_a_batch_of_invalid_rows_only_is_skipped_or_kept_in_the_declared_layout(task, outputs):
    invalid = batch([None, NAN, [1e39, 0.0, 0.0]])        # null, NaN, beyond float32
    skipped = score([invalid, batch([GOOD])], "skip", outputs, task)
    assert [b.num_rows for b in skipped] == [0, 1]
    kept = score([invalid, batch([GOOD])], "keep", outputs, task)
    assert kept[0].num_rows == 3 and np.isnan(kept[0].column("prediction").to_numpy()).all()
    assert kept[0].schema.names == kept[1].schema.names == skipped[0].schema.names
    if task != "regression":
        assert kept[0].column("probability").null_count == 3 and kept[1].column("probability").null_count == 0
        assert kept[0].schema.field("probability").type == kept[1].schema.field("probability").type


def test_kept_rows_keep_their_places_and_the_others_their_predictions():
    rows = [GOOD, None, [0.5, 0.4, 0.3], NAN, [0.9, 0.1, 0.0]]
    kept = score([batch(rows)], "keep")[0]
    clean = score([batch([rows[0], rows[2], rows[4]])], "error")[0]
    prediction = kept.column("prediction").to_numpy()
    assert np.isnan(prediction[[1, 3]]).all()
    assert prediction[[0, 2, 4]].tolist() == clean.column("prediction").to_pylist()
    assert kept.column("probability").is_null().to_pylist() == [False, True, False, True, False]


def test_several_numeric_columns_are_checked_together():
    columns = ColumnSpec(features_col=None, features_cols=("a", "b", "c"), label_col=None)
    frame = pa.RecordBatch.from_arrays([pa.array([1.0, 2.0, 3.0]), pa.array([1, None, 3], pa.int64()),
                                        pa.array([0.5, 0.5, float("inf")])], names=["a", "b", "c"])
    out = score([frame], "skip", columns=columns)[0]
    assert out.num_rows == 1 and out.column("a").to_pylist() == [1.0]


_SCORING_SETUP = """
from torch import nn
from sparkdl.ml._persistence import state_to_bytes
from sparkdl.ml._scoring import scoring_model

def table():   # 25M parameters (100 MB): an embedding table of 390,625 rows x 64
    return nn.Embedding(390_625, 64)

state = state_to_bytes(table().state_dict())
scoring_model(table, state)        # fits without a limit
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space from /proc (Linux)")
def test_a_model_that_cannot_fit_a_python_worker_is_refused_before_scoring_builds_it():
    """Under 150 MB of address-space headroom (as spark.executor.pyspark.memory sets it) a model whose saved
    state is 100 MB (a table, say) is refused with the setting to change, not a bare MemoryError."""
    printed = refused_under_headroom(_SCORING_SETUP, "scoring_model(table, state)", headroom_mb=150)
    assert "the model for scoring needs 191 MiB" in printed and "spark.executor.pyspark.memory" in printed


_SHARED_SCORING_SETUP = """
from pyspark import cloudpickle
from torch import nn
from sparkdl.ml._scoring import SharedModel, _model_for

def table():   # never built: the spec is refused before the model is
    return nn.Embedding(781_250, 64)

state = bytes(200_000_000)   # the saved state's 200 MB, as the spec carries it
shared = SharedModel("k", cloudpickle.dumps((table, state)))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space from /proc (Linux)")
def test_a_scoring_spec_the_worker_cannot_hold_is_refused_before_it_is_unpickled():
    """The spec that every scoring task unpickles carries the saved state: 200 MB of it under 150 MB of headroom
    is refused with its size and the setting to change, before the unpickling can end in a bare MemoryError."""
    printed = refused_under_headroom(_SHARED_SCORING_SETUP, "_model_for(shared, 'cpu', [])", headroom_mb=150)
    assert "loading the model to score (its saved state) needs 191 MiB" in printed
    assert "spark.executor.pyspark.memory" in printed


def test_a_half_precision_model_takes_its_inputs_in_its_dtype_and_its_embedding_arrives_as_float32():
    from sparkdl._internal.data.block import RowBlock
    from sparkdl.ml._scoring import predict_arrays

    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        model = nn.Linear(3, 2).to(dtype).eval()
        rows = np.array([GOOD, [0.5, 0.4, 0.3]], dtype=np.float32)
        values = predict_arrays(model, torch.device("cpu"), RowBlock((rows,)), OutputSpec("embedding", "e"), 16)
        assert values["e"].dtype == np.float32
        assert values["e"].tolist() == model(torch.from_numpy(rows).to(dtype)).float().tolist()


def test_the_precision_setting_scores_under_its_autocast():
    from sparkdl._internal.data.block import RowBlock
    from sparkdl.ml._scoring import predict_arrays

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    rows = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    x = torch.from_numpy(rows)
    with torch.inference_mode():
        exact = model(x).float().numpy()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(x).float().numpy()
    assert not np.array_equal(exact, bf16)      # bfloat16 rounds these: the two are told apart
    outputs = OutputSpec("embedding", "e")
    scored = {precision: predict_arrays(model, torch.device("cpu"), RowBlock((rows,)), outputs, 4,
                                        precision=precision)["e"] for precision in ("32", "bf16-mixed")}
    assert np.array_equal(scored["32"], exact) and np.array_equal(scored["bf16-mixed"], bf16)


# How many Arrow batches the scorer has taken from its input (read by the model below, run in this process).
_TAKEN: list[int] = []


class _WaitsForTheNextBatch(nn.Module):
    """Records, at each forward, whether the scorer took the next Arrow batch while this one ran (5 s at most)."""

    seen: list[bool] = []

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wanted, deadline = len(self.seen) + 2, time.monotonic() + 5
        while len(_TAKEN) < wanted and time.monotonic() < deadline:
            time.sleep(0.01)
        self.seen.append(len(_TAKEN) >= wanted)
        return self.linear(x)


def test_the_next_batch_is_read_and_converted_while_the_model_runs_the_current_one():
    _TAKEN.clear()
    _WaitsForTheNextBatch.seen.clear()

    def batches():
        for k in range(3):
            _TAKEN.append(k)
            yield batch([GOOD, [0.5, 0.4, 0.3]])

    spec = ScoringSpec(_WaitsForTheNextBatch, state_to_bytes(_WaitsForTheNextBatch().state_dict()),
                       ColumnSpec(label_col=None), OutputSpec("multiclass", "prediction", "probability"), "cpu", 16,
                       handle_invalid="error")
    scored = list(make_scorer(spec, BytesBackend())(batches()))
    assert [b.num_rows for b in scored] == [2, 2, 2]
    # the first two forwards ran while the next batch was already taken (the last has none after it)
    assert _WaitsForTheNextBatch.seen[:2] == [True, True]
