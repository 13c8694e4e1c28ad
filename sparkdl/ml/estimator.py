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

from ..config import TrainConfig
from ..data.arrow import ColumnSpec, DataRules
from ..data.schema import (
    check_features_shape,
    explain_bad_rows,
    feature_width,
    first_features,
    validate_columns,
    validate_dataframe,
)
from ..errors import DataError
from ..modes.launcher import train_dataframe
from ..training.pipeline_cuts import whole_model
from ..transforms import resolve_transform
from .connect_io import ConnectAwareReader, ConnectAwareWriter
from .model import TorchModel, prediction_task
from .params import ESTIMATOR_PARAMS, MODEL_PARAMS, PARAM_SETTINGS, TorchEstimatorParams, add_accessors


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
    width = feature_width(first)
    check_features_shape(columns, width)
    return first, width


def _output_width(model_fn: Callable[[], nn.Module], sample: torch.Tensor) -> int:
    """Outputs per row of the model, found by one forward pass on the driver."""
    module = whole_model(model_fn).eval()
    try:
        with torch.inference_mode():
            output = module(sample)
    except Exception as exc:
        raise ValueError(f"the model does not accept feature rows of shape {list(sample.shape[1:])} ({exc}); "
                         "check featuresCol(s), featuresShape and batchTransform") from exc
    return int(np.prod(output.shape[1:])) if output.dim() > 1 else 1


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
        first, row_width = _first_row_width(dataset, columns, decoder)
        width = _output_width(model_fn, _model_input(first, columns, row_width, transform))
        task = prediction_task(self.getLoss(), width)
        classes = width if task == "multiclass" else 2 if task == "binary" else None
        try:   # the tasks check their rows as they load them, before any update
            result = train_dataframe(dataset, model_fn, config, columns, DataRules(row_width, classes))
        except DataError:
            # one scan of the whole DataFrame says what is wrong in its own terms (column, row, count)
            try:
                explain_bad_rows(dataset, columns, decoder, classes)
            except ValueError as explained:
                raise explained from None
            raise
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
