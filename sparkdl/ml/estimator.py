"""TorchEstimator: pyspark.ml Estimator that trains a PyTorch model with the parameter server."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame
from torch import nn

from sparkdl._internal.data.block import Batch, Ragged, RowBlock
from sparkdl._internal.data.cache import in_memory_partition
from sparkdl._internal.data.checks import DataRules
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl._internal.data.partitions import Padding, transformed
from sparkdl._internal.data.rows import rows_to_block
from sparkdl._internal.data.schema import (
    check_features_shape,
    explain_bad_rows,
    feature_width,
    first_features,
    schema_sample,
    validate_columns,
    validate_dataframe,
)
from sparkdl._internal.modes.launcher import train_dataframe
from sparkdl._internal.training.inputs import ModelCall, forward_parameters
from sparkdl._internal.training.losses import accepts_weight
from sparkdl._internal.training.pipeline_cuts import whole_model
from sparkdl.config import TrainConfig
from sparkdl.errors import DataError
from sparkdl.ml._connect_io import ConnectAwareReader, ConnectAwareWriter
from sparkdl.ml._outputs import prediction_task
from sparkdl.ml._params import ESTIMATOR_PARAMS, MODEL_PARAMS, PARAM_SETTINGS, TorchEstimatorParams, add_accessors
from sparkdl.ml.model import TorchModel
from sparkdl.transforms import resolve_transform

__all__ = ["TorchEstimator"]


def _model_input(first: tuple[Any, ...], columns: ColumnSpec, width: int | None, transform: Any) -> torch.Tensor:
    """Two rows as the model sees them: zeros of the row shape, or the first encoded row, through the transform."""
    if width is None:      # encoded rows: their decoded shape is only known from a real row
        raw: Any = [bytes(first[0]), bytes(first[0])]
    else:
        raw = torch.zeros((2, *(columns.features_shape or (width,))))
    if transform is None:
        return raw
    try:
        return transform(raw, None)
    except Exception as exc:
        raise ValueError(f"batchTransform fails on the first rows of the data ({type(exc).__name__}: {exc})") from exc


def _first_row_width(dataset: DataFrame, columns: ColumnSpec, decoder: bool) -> tuple[tuple[Any, ...], int | None]:
    """The first row's features and their width (one small Spark job), with the checks one row allows."""
    first = first_features(dataset, columns)
    if first is None:
        raise ValueError("the DataFrame is empty; there is nothing to train on")
    if any(value is None for value in first):     # the scan names the column and counts the null rows
        validate_dataframe(dataset, columns, decoder)
    if columns.typed:
        return first, None
    width = feature_width(first)
    check_features_shape(columns, width)
    return first, width


def _typed_sample(first: tuple[Any, ...], columns: ColumnSpec, config: TrainConfig, transform: Any) -> Batch:
    """The first row, twice, as the model receives it: one tensor per input column, padded, transformed."""
    try:
        block = rows_to_block([(tuple(first), 0)] * 2)
    except DataError as exc:
        raise ValueError(f"the first row of inputCols {list(columns.input_cols)} cannot be read: {exc}") from None
    fields = []
    for i, field in enumerate(block.inputs):
        shape = columns.shape_of(i)
        if shape is not None:
            dense = field.values.reshape(len(field), -1) if isinstance(field, Ragged) else field.reshape(len(field), -1)
            if dense.shape[1] != int(np.prod(shape)):
                raise ValueError(f"the row shape {list(shape)} of column {columns.input_cols[i]!r} needs "
                                 f"{int(np.prod(shape))} values per row, its first row has {dense.shape[1]}")
            field = dense.reshape(len(dense), *shape)
        fields.append(field)
    batch = in_memory_partition([RowBlock(tuple(fields))], torch.device("cpu")).gather(
        torch.arange(2), Padding(config.pad_value, config.sequence_length))
    if transform is None:
        return batch
    try:
        inputs, masks = transformed(transform, batch.inputs, batch.masks, None)
    except Exception as exc:
        raise ValueError(f"batchTransform fails on the first rows of the data ({type(exc).__name__}: {exc})") from exc
    return Batch(inputs, masks, None)


def _output_width_of(first: tuple[Any, ...], row_width: int | None, model_fn: Callable[[], nn.Module],
                     config: TrainConfig, columns: ColumnSpec, transform: Any) -> int:
    """The model's outputs per row, from one forward pass over ``first`` (a real row, or the schema's zeros)."""
    sample = (_typed_sample(first, columns, config, transform) if columns.typed
              else _model_input(first, columns, row_width, transform))
    if (isinstance(sample, Batch) and config.mode.pipelined and config.sequence_length is None
            and any(mask is not None for mask in sample.masks)):
        raise ValueError("pipeline stages fix their activation shapes at the first step, so ragged inputs "
                         "(arrays of varying length) need one length: set sequenceLength (sequence_length)")
    return _output_width(model_fn, sample, columns)


def _input_and_output_width(dataset: DataFrame, model_fn: Callable[[], nn.Module], config: TrainConfig,
                            columns: ColumnSpec, transform: Any) -> tuple[int | None, int, bool]:
    """(feature values per row or None for typed inputs, the model's outputs per row, whether a row was read).

    Where the schema fixes every input's shape the model runs on a row of zeros and no Spark job reads the
    data (the tasks check their rows' shapes as they load them); else, or when the model refuses the zeros
    (an id it shifts below 0, say), on the first row, read by one small job, whose errors name real data.
    """
    zeros = schema_sample(dataset, columns)
    if zeros is not None:
        row_width = None if columns.typed else feature_width(zeros)
        check_features_shape(columns, row_width)
        try:
            return row_width, _output_width_of(zeros, row_width, model_fn, config, columns, transform), False
        except ValueError:
            pass        # the first row decides, and its error is the one to show
    first, row_width = _first_row_width(dataset, columns, transform is not None)
    return row_width, _output_width_of(first, row_width, model_fn, config, columns, transform), True


def _forward_names(module: nn.Module) -> list[str]:
    return [name for name, p in forward_parameters(module).items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]


def _output_width(model_fn: Callable[[], nn.Module], sample: torch.Tensor | Batch, columns: ColumnSpec) -> int:
    """Outputs per row of the model, found by one forward pass on the driver."""
    module = whole_model(model_fn).eval()
    try:
        with torch.inference_mode():
            if isinstance(sample, Batch):
                output = ModelCall.for_module(module, columns.input_args)(module, sample.inputs, sample.masks)
            else:
                output = module(sample)
    except Exception as exc:
        if not isinstance(sample, Batch):
            raise ValueError(f"the model does not accept feature rows of shape {list(sample.shape[1:])} ({exc}); "
                             "check featuresCol(s), featuresShape and batchTransform") from exc
        shapes = ", ".join(f"{name}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                           for name, v in zip(columns.input_cols, sample.inputs, strict=False))
        wanted = _forward_names(module)
        how = (f"as the keyword arguments {list(columns.input_args)}" if columns.input_args
               else f"as {len(sample.inputs)} positional arguments")
        raise ValueError(f"the model's forward({', '.join(wanted)}) fails on the inputs of inputCols "
                         f"{list(columns.input_cols)}, given {how} ({shapes}): {type(exc).__name__}: {exc}. Give one "
                         "input column per forward argument, in order (or name them with inputArgs)") from exc
    if isinstance(output, (tuple, list)) or not isinstance(output, torch.Tensor):
        raise ValueError(f"the model's forward returns {type(output).__name__}; the named losses need one tensor "
                         "(return the logits or predictions)")
    return int(np.prod(output.shape[1:])) if output.dim() > 1 else 1


def _check_weights_and_labels(config: TrainConfig, columns: ColumnSpec, dataset: DataFrame) -> None:
    """Before launch: a weight column needs a loss that can weigh rows; labels' shapes must suit the loss."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    if columns.weight_col:
        if callable(config.loss) and not accepts_weight(config.loss):
            raise ValueError(f"weightCol={columns.weight_col!r} is set, but the loss {config.loss!r} takes no "
                             "weight= argument; give it one (loss(output, target, weight=None)) or use a named loss")
        if config.mode.pipelined:
            raise ValueError("weightCol is not supported with pipeline_stages > 1: the stages weigh every row "
                             "alike")
    label = {f.name: f.dataType for f in dataset.schema.fields}.get(columns.label_col or "")
    if config.loss == "cross_entropy" and isinstance(label, (T.ArrayType, VectorUDT)):
        raise ValueError(f"label column {columns.label_col!r} holds vectors, but cross_entropy takes one class "
                         "index per row; for multi-label targets use loss='bce_with_logits'")


#: TrainConfig field name -> its Param name
PARAM_NAMES = {spec.name: spec.param for spec in PARAM_SETTINGS}


class TorchEstimator(Estimator, TorchEstimatorParams, MLWritable, MLReadable):
    """Trains ``model()`` on a DataFrame with sparkdl's parameter server.

    >>> est = TorchEstimator(model=make_net, loss="cross_entropy", optimizer="adam",
    ...                      learningRate=1e-3, batchSize=32, epochs=10, numWorkers=2,
    ...                      updatePolicy="softsync")
    >>> model = est.fit(train_df)          # a TorchModel
    """

    _input_kwargs: dict[str, Any]   # set by @keyword_only (declared for the type checker only)

    @keyword_only
    def __init__(self, **params: Any) -> None:
        """Any Param by keyword: ``model`` plus every name in ``ESTIMATOR_PARAMS``."""
        super().__init__()
        self.setParams(**self._input_kwargs)

    @keyword_only
    def setParams(self, **params: Any) -> TorchEstimator:
        """Set any Params by keyword (None leaves a Param unchanged); an unknown name is a TypeError."""
        known = sorted(param.name for param in self.params)
        unknown = sorted(set(params) - set(known))
        if unknown:
            # a TrainConfig field name is the likely slip: name its Param
            hints = "".join(f"; {name} is the Param {PARAM_NAMES[name]!r}" for name in unknown if name in PARAM_NAMES)
            raise TypeError(f"TorchEstimator has no Param(s) {unknown}{hints}; known: {known}")
        return self._set(**{name: value for name, value in params.items() if value is not None})

    @classmethod
    def from_train_config(cls, config: TrainConfig, **params: Any) -> TorchEstimator:
        """An estimator whose training Params are ``config``'s; ``params`` sets the others (model, columns)."""
        estimator = cls(**params)
        estimator.set_train_config(config)
        return estimator

    @classmethod
    def _from_saved(cls, state: Any, history: Any, summary: Any, gradients: Any = None) -> TorchEstimator:
        return cls()

    def _fit(self, dataset: DataFrame) -> TorchModel:
        model_fn = self.getModel()
        if not callable(model_fn):
            raise ValueError("set the 'model' Param to a zero-argument callable returning a torch.nn.Module")
        config = self.train_config()       # validates every training setting
        columns = self.column_spec(with_label=True)
        transform = resolve_transform(config.batch_transform)
        decoder = transform is not None
        validate_columns(dataset, columns, decoder)
        _check_weights_and_labels(config, columns, dataset)
        row_width, width, row_read = _input_and_output_width(dataset, model_fn, config, columns, transform)
        task = prediction_task(self.getLoss(), width)
        classes = width if task == "multiclass" else 2 if task == "binary" else None
        rules = DataRules(None if columns.typed else row_width, classes, config.sequence_length)
        try:   # the tasks check their rows as they load them, before any update
            result = train_dataframe(dataset, model_fn, config, columns, rules)
        except DataError:
            # one scan of the whole DataFrame says what is wrong in its own terms (column, row, count)
            try:
                explain_bad_rows(dataset, columns, decoder, classes)
            except ValueError as explained:
                raise explained from None
            raise
        if not row_read and not config.resume_from and result.summary.get("samples") == 0:
            # no job read a row before launch; the tasks found none (an untrained model is no result)
            raise ValueError("the DataFrame is empty; there is nothing to train on")
        fitted = TorchModel._from_saved(result.state_dict, result.history.to_dict("records"),
                                        {**result.summary, "task": task, "output_width": width},
                                        result.gradients.to_dict("records"))
        fitted._resetUid(self.uid.replace("TorchEstimator", "TorchModel"))
        for name in MODEL_PARAMS:
            if self.isDefined(name):
                fitted._set(**{name: self.getOrDefault(name)})
        return fitted

    def write(self) -> ConnectAwareWriter:
        """A writer for this instance (classic or Spark Connect session)."""
        return ConnectAwareWriter(self)

    @classmethod
    def read(cls) -> ConnectAwareReader:
        """A reader of saved instances (classic or Spark Connect session)."""
        return ConnectAwareReader(cls)


add_accessors(TorchEstimator, ESTIMATOR_PARAMS)
# help() and IDEs show every Param that the **params methods accept
_KEYWORDS = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in ESTIMATOR_PARAMS])
TorchEstimator.__init__.__signature__ = _KEYWORDS  # type: ignore[attr-defined]
TorchEstimator.setParams.__signature__ = _KEYWORDS  # type: ignore[attr-defined]
