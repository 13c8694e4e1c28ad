"""Executor side of TorchModel.transform: Arrow batches in, the same batches plus predictions out."""
from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from pyspark import cloudpickle
from torch import nn

from sparkdl._internal.data.arrow import arrow_to_block, null_feature_rows
from sparkdl._internal.data.block import Ragged, RowBlock, is_encoded
from sparkdl._internal.data.cache import in_memory_partition
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl._internal.data.partitions import DEFAULT_PADDING, Padding, run_ahead, transformed
from sparkdl._internal.memory import require_address_space
from sparkdl._internal.spark.backend import SparkBackend, load_shared
from sparkdl._internal.spark.devices import gpu_addresses, select_device
from sparkdl._internal.training.inputs import ModelCall
from sparkdl._internal.training.pipeline_cuts import whole_model
from sparkdl._internal.training.precision import MixedPrecision
from sparkdl.errors import DataError
from sparkdl.ml._model_sources import SavedProgram, carries_weights
from sparkdl.ml._outputs import OutputSpec
from sparkdl.ml._scoring_report import TaskTimes
from sparkdl.transforms import BatchTransform, resolve_transform


@dataclass(frozen=True)
class ScoringSpec:
    """What every scoring task needs; shipped once per executor (see :func:`make_scorer`)."""

    #: the model's factory and torch.save(state_dict) (empty when the factory's modules carry their weights);
    #: None and empty in the spec the tasks get (they get these through :class:`SharedModel`)
    model_fn: Callable[[], nn.Module] | None
    state: bytes
    columns: ColumnSpec
    outputs: OutputSpec        # what each row gets
    device: str
    batch_size: int
    batch_transform: BatchTransform | str | None = None    # applied without its random parts
    #: rows with null, NaN or infinite features: "error", "skip" (left out) or "keep" (prediction NaN)
    handle_invalid: str = "error"
    padding: Padding = DEFAULT_PADDING      # ragged inputs are padded as in training
    precision: str = "32"                   # the forward under autocast, as the training's (see MixedPrecision)


#: TorchModel's handleInvalid values
HANDLE_INVALID = ("error", "skip", "keep")


# One model per Python worker process: built on first use, reused by later tasks, queries, transforms and SQL
# functions of the same model and weights on the same device, whatever their output settings.
_MODELS: dict[str, tuple[nn.Module, torch.device]] = {}


#: bytes a Python worker allocates per byte of the saved state while it builds the model to score: the
#: module's own tensors, and the loaded state they are copied from
SCORING_BYTES_PER_STATE_BYTE = 2


#: what to do when the model to score cannot fit a Python worker
SCORING_MEMORY_ADVICE = ("Scoring builds the whole model in every Python worker, embedding tables included: give the "
                         "executors more memory (spark.executor.pyspark.memory) or fewer task slots each")


def scoring_model(model_fn: Callable[[], nn.Module], state: bytes) -> nn.Module:
    """The model, whole, on the CPU; a clear error first when it cannot fit this Python worker."""
    require_address_space(SCORING_BYTES_PER_STATE_BYTE * len(state), "the model for scoring", SCORING_MEMORY_ADVICE)
    if carries_weights(model_fn):
        return model_fn()
    model = whole_model(model_fn)   # scored unsplit: pipelines are for training
    model.load_state_dict(torch.load(io.BytesIO(state), map_location="cpu", weights_only=True))
    return model


@dataclass(frozen=True)
class SharedModel:
    """The model as the tasks get it: its digest (the per-worker cache key) and the pickled (factory, state)
    as ``backend.share`` ships it (a broadcast in classic PySpark, the bytes inside the query plan under
    Spark Connect), read only by a worker that has not built it yet."""

    key: str
    shared: Any


class SharedModels:
    """What a :class:`~sparkdl.ml.TorchModel` (and its copies) last shared with a session, reused by its later
    ``transform`` and ``udf`` calls while its factory and weights pickle to the same bytes (the same digest): the
    model is broadcast (or uploaded) once, not once per call.  The digest is taken at every call, so weights
    changed in any way since are shared anew."""

    def __init__(self) -> None:
        self._last: tuple[Any, SharedModel] | None = None

    def share(self, data: bytes, backend: SparkBackend) -> SharedModel:
        """``data`` (the pickled factory and state) as the tasks of ``backend``'s session get it."""
        key = hashlib.sha256(data).hexdigest()
        session, last = backend.session, self._last     # read once: another thread may replace it
        if last is not None and last[0] is session and last[1].key == key:
            return last[1]
        shared = SharedModel(key, backend.share(data))
        self._last = (session, shared)
        return shared

    def __getstate__(self) -> dict[str, Any]:
        return {"_last": None}     # a broadcast belongs to its session: a pickled model shares anew


def share_model(spec: ScoringSpec, backend: SparkBackend,
                shared_models: SharedModels | None = None) -> tuple[SharedModel, ScoringSpec]:
    """(the spec's model and weights, shared, or what ``shared_models`` shared of them already; the rest of the
    spec, small enough to travel with the function)."""
    data = cloudpickle.dumps((spec.model_fn, spec.state))
    light = dataclasses.replace(spec, model_fn=None, state=b"")
    return (shared_models or SharedModels()).share(data, backend), light


def _model_for(model: SharedModel, device_setting: str, addresses: list[str]) -> tuple[nn.Module, torch.device]:
    device = select_device(device_setting, addresses)
    key = f"{model.key}@{device}"
    cached = _MODELS.get(key)
    if cached is None:
        # once per worker process and device, not per task
        model_fn, state = load_shared(model.shared, "loading the model to score (its saved state)",
                                      SCORING_MEMORY_ADVICE)
        built = (model_fn.module_on(device) if isinstance(model_fn, SavedProgram)
                 else scoring_model(model_fn, state).to(device).eval())
        cached = (built, device)
        _MODELS.clear()     # a new model replaces the previous one: bounded memory per worker
        _MODELS[key] = cached
    return cached


def _bad_values(field: np.ndarray | Ragged, typed: bool) -> np.ndarray:
    """Per row: it holds NaN/Inf (floating values) or a negative id (integer inputs)."""
    values = field.values if isinstance(field, Ragged) else field.reshape(len(field), -1)
    if values.dtype.kind == "f":
        bad_values = ~np.isfinite(values)
    elif values.dtype.kind == "i" and typed:
        bad_values = values < 0
    else:
        return np.zeros(len(field), dtype=bool)
    if not isinstance(field, Ragged):
        return bad_values.any(axis=1)
    rows = np.zeros(len(field), dtype=bool)
    rows[np.searchsorted(field.offsets, np.flatnonzero(bad_values), side="right") - 1] = True
    return rows


def invalid_rows(batch: pa.RecordBatch, columns: ColumnSpec, max_length: int | None = None
                 ) -> tuple[np.ndarray, RowBlock]:
    """(a mask of the rows whose inputs are null, hold nulls, NaN or infinite values or negative ids, or
    sequences longer than ``max_length``; the other rows, converted)."""
    invalid = null_feature_rows(batch, columns)
    block = arrow_to_block([batch.filter(pa.array(~invalid)) if invalid.any() else batch], columns)
    if not len(block):
        return invalid, block
    bad = np.zeros(len(block), dtype=bool)
    for field in block.inputs:
        if not is_encoded(field):
            bad |= _bad_values(field, columns.typed)
        if isinstance(field, Ragged) and max_length is not None:
            bad |= field.lengths > max_length
    if bad.any():
        invalid[np.flatnonzero(~invalid)[bad]] = True
        block = block.take(np.flatnonzero(~bad))
    return invalid, block


def _invalid_rows_error(invalid: np.ndarray, first_row: int, columns: ColumnSpec) -> DataError:
    i = first_row + int(np.argmax(invalid))
    names = ", ".join(map(repr, columns.input_columns))
    what = "values, negative ids or sequences over sequenceLength" if columns.typed else "features"
    return DataError(f"TorchModel.transform: row {i} of the partition has null, NaN or infinite (as float32) "
                     f"{what} in {names} ({int(invalid.sum())} such rows in this Arrow batch); drop or impute them, "
                     "or set handleInvalid to 'skip' (leave them out of the output) or 'keep' (prediction NaN, "
                     "probability null)")


def model_batches(block: RowBlock, batch_size: int, transform: BatchTransform | None = None,
                  padding: Padding = DEFAULT_PADDING) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """(inputs, masks) of each run of ``batch_size`` rows of ``block``, padded as in training; ``transform`` is
    the training's batch transform, called without a generator (no random parts)."""
    rows = len(block)
    if not rows:
        return
    partition = in_memory_partition([block], torch.device("cpu"))
    for start in range(0, rows, batch_size):
        batch = partition.gather(torch.arange(start, min(start + batch_size, rows)), padding)
        inputs, masks = batch.inputs, batch.masks
        if transform is not None:
            inputs, masks = transformed(transform, inputs, masks, None)
        elif not all(isinstance(value, torch.Tensor) for value in inputs):
            raise ValueError("the features are encoded bytes: set batchTransform to decode them")
        yield tuple(inputs), tuple(masks)


class Forward:
    """The model on one batch of inputs: the added columns' values (``outputs.columns_of``), on the CPU.

    Under ``torch.inference_mode`` and the ``precision`` setting's autocast; a float16 / bfloat16 model takes
    its floating inputs in its own dtype.
    """

    def __init__(self, model: nn.Module, device: torch.device, outputs: OutputSpec, call: ModelCall | None = None,
                 precision: str = "32") -> None:
        self.model, self.device, self.outputs = model, device, outputs
        self.call = call or ModelCall()
        self.autocast = MixedPrecision(precision, device).autocast
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)

    def __call__(self, inputs: tuple[Any, ...], masks: tuple[Any, ...]) -> dict[str, torch.Tensor]:
        dtype = self.dtype
        with torch.inference_mode(), self.autocast():
            output = self.call(self.model, [value.to(self.device, dtype if dtype and value.is_floating_point()
                                                     else None) for value in inputs],
                               [None if mask is None else mask.to(self.device) for mask in masks])
            return {name: values.cpu() for name, values in self.outputs.columns_of(output).items()}


def collected(parts: list[dict[str, torch.Tensor]], outputs: OutputSpec) -> dict[str, np.ndarray]:
    """The columns of several batches' :class:`Forward` results, in order (empty columns for none)."""
    if not parts:   # no rows (all left out as invalid): empty columns, still there
        return {name: outputs.empty(name) for name in outputs.names}
    values = {}
    for name in parts[0]:
        pieces = [part[name] for part in parts]
        widths = {piece.shape[1:] for piece in pieces}
        if len(widths) > 1:
            raise ValueError(f"the model's output for {name!r} changes width between batches ({sorted(widths)}): an "
                             "output per position of ragged inputs follows each batch's padding; set sequenceLength "
                             "so that every batch is padded to the same length")
        values[name] = torch.cat(pieces).numpy()
    return values


def predict_arrays(model: nn.Module, device: torch.device, block: RowBlock, outputs: OutputSpec, batch_size: int,
                   transform: BatchTransform | None = None, call: ModelCall | None = None,
                   padding: Padding = DEFAULT_PADDING, precision: str = "32") -> dict[str, np.ndarray]:
    """The added columns' values for a block of rows, padded and called as in training (see :class:`Forward`)."""
    forward = Forward(model, device, outputs, call, precision)
    return collected([forward(*inputs) for inputs in model_batches(block, batch_size, transform, padding)], outputs)


@dataclass(frozen=True)
class _ArrowBatch:
    """Marks where an Arrow batch's model inputs begin (its rows, and which of them are invalid)."""

    batch: pa.RecordBatch
    invalid: np.ndarray


_END_OF_BATCH = object()


class BatchScorer:
    """One task's scoring: the worker's model (built once per Python worker), applied to Arrow batches."""

    def __init__(self, model: SharedModel, spec: ScoringSpec) -> None:
        from pyspark import TaskContext

        context = TaskContext.get()
        torch.set_num_threads(max(1, context.cpus()) if context else 1)
        addresses = gpu_addresses(context.resources()) if context else []
        module, device = _model_for(model, spec.device, addresses)
        self.spec, self.model_key = spec, model.key
        self.times = TaskTimes()
        self.forward = Forward(module, device, spec.outputs, ModelCall.for_module(module, spec.columns.input_args),
                               spec.precision)
        self.transform = resolve_transform(self.spec.batch_transform)
        self.first_row = 0     # of the partition, for error messages

    def score_all(self, batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[pa.RecordBatch, np.ndarray,
                                                                            dict[str, np.ndarray]]]:
        """Each batch with a mask of its invalid rows and the valid rows' added columns; fails on invalid rows
        under "error".  The next batches are read, checked, converted and batch-transformed (decoded) on a
        background thread while the model runs the current one."""
        current: _ArrowBatch | None = None
        parts: list[dict[str, torch.Tensor]] = []
        times = self.times
        for item in run_ahead(self._model_inputs(batches)):
            if isinstance(item, _ArrowBatch):
                current, parts = item, []
            elif item is _END_OF_BATCH:
                assert current is not None
                with times.timing("write"):      # the caller converts and hands the results to Spark meanwhile
                    yield current.batch, current.invalid, collected(parts, self.spec.outputs)
            else:
                with times.timing("model"):
                    parts.append(self.forward(*item))
        times.log(self.model_key)

    def _model_inputs(self, batches: Iterator[pa.RecordBatch]) -> Iterator[Any]:
        """Per Arrow batch: its :class:`_ArrowBatch`, the model's inputs of each of its runs of rows, and the end."""
        spec, times = self.spec, self.times
        for batch in times.timed(batches, "read"):
            with times.timing("convert"):
                invalid, block = invalid_rows(batch, spec.columns, spec.padding.length)
            if invalid.any() and spec.handle_invalid == "error":
                raise _invalid_rows_error(invalid, self.first_row, spec.columns)
            self.first_row += batch.num_rows
            times.rows += batch.num_rows
            yield _ArrowBatch(batch, invalid)
            yield from times.timed(model_batches(block, spec.batch_size, self.transform, spec.padding), "convert")
            yield _END_OF_BATCH


def make_scorer(spec: ScoringSpec, backend: SparkBackend, shared_models: SharedModels | None = None
                ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The mapInArrow function of transform: appends the columns ``spec.outputs`` names.

    The broadcast lives as long as the transformed DataFrame may run, so it is not released here.
    """
    model, light = share_model(spec, backend, shared_models)
    outputs, handle_invalid = spec.outputs, spec.handle_invalid

    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        scorer = BatchScorer(model, light)
        for batch, invalid, values in scorer.score_all(batch for batch in batches if batch.num_rows):
            if handle_invalid == "skip" and invalid.any():
                batch = batch.filter(pa.array(~invalid))
            missing = invalid if handle_invalid == "keep" and invalid.any() else None
            yield pa.RecordBatch.from_arrays(batch.columns + outputs.to_arrow(values, missing),
                                             names=batch.schema.names + outputs.names)

    return score
