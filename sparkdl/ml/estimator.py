"""TorchEstimator: pyspark.ml Estimator that trains a PyTorch model with the parameter server."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame
from torch import nn

from ..runtime.columns import check_class_labels, validate_dataframe
from ..runtime.launcher import train_dataframe
from .model import TorchModel, prediction_task
from .params import ESTIMATOR_PARAMS, MODEL_PARAMS, TorchEstimatorParams, add_accessors
from .persistence import TorchReader, TorchWriter


def _output_width(model_fn: Callable[[], nn.Module], row_shape: tuple[int, ...]) -> int:
    """Outputs per row of the model, found by one forward pass of zeros on the driver."""
    module = model_fn().eval()
    try:
        with torch.inference_mode():
            output = module(torch.zeros((2, *row_shape)))
    except Exception as exc:
        raise ValueError(f"the model does not accept feature rows of shape {list(row_shape)} ({exc}); "
                         "check featuresCol(s) and featuresShape") from exc
    return int(np.prod(output.shape[1:])) if output.dim() > 1 else 1


class TorchEstimator(Estimator, TorchEstimatorParams, MLWritable, MLReadable):
    """Trains ``model()`` on a DataFrame with sparkdl's parameter server.

    >>> est = TorchEstimator(model=make_net, loss="cross_entropy", optimizer="adam",
    ...                      learningRate=1e-3, batchSize=32, epochs=10, numWorkers=2,
    ...                      updatePolicy="softsync")
    >>> model = est.fit(train_df)          # a TorchModel
    """

    @keyword_only
    def __init__(self, *, model: Callable[[], nn.Module] | None = None, loss: Any = None,
                 optimizer: str | None = None, learningRate: float | None = None, momentum: float | None = None,
                 weightDecay: float | None = None, batchSize: int | None = None, epochs: int | None = None,
                 numWorkers: int | None = None, updatePolicy: str | None = None, softsyncSize: int | None = None,
                 localSteps: int | None = None, stalenessLr: str | None = None, maxStaleness: int | None = None,
                 seed: int | None = None, featuresCol: str | None = None, featuresCols: list[str] | None = None,
                 featuresShape: list[int] | None = None, labelCol: str | None = None,
                 predictionCol: str | None = None, probabilityCol: str | None = None,
                 checkpointDir: str | None = None, checkpointEvery: int | None = None,
                 resumeFrom: str | None = None, maxAttempts: int | None = None, nonfinite: str | None = None,
                 verbose: bool | None = None, compression: str | None = None, topkRatio: float | None = None,
                 device: str | None = None,
                 timeout: float | None = None, inferenceBatchSize: int | None = None) -> None:
        super().__init__()
        self.setParams(**self._input_kwargs)

    @keyword_only
    def setParams(self, **kwargs: Any) -> "TorchEstimator":
        """Set any of the constructor's Params by keyword (None leaves a Param unchanged)."""
        return self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    @classmethod
    def _from_saved(cls, state: Any, history: Any, summary: Any, gradients: Any = None) -> "TorchEstimator":
        return cls()

    def _fit(self, dataset: DataFrame) -> TorchModel:
        model_fn = self.getModel()
        if not callable(model_fn):
            raise ValueError("set the 'model' Param to a zero-argument callable returning a torch.nn.Module")
        config = self.train_config()       # validates every training setting
        columns = self.column_spec(with_label=True)
        stats = validate_dataframe(dataset, columns)
        row_shape = columns.features_shape or (stats.width,)
        width = _output_width(model_fn, tuple(row_shape))
        task = prediction_task(self.getLoss(), width)
        if task == "multiclass":
            check_class_labels(stats, self.getLabelCol(), width)
        elif task == "binary":
            check_class_labels(stats, self.getLabelCol(), 2)
        result = train_dataframe(dataset, model_fn, config, columns)
        fitted = TorchModel._from_saved(result.state_dict, result.history.to_dict("records"),
                                        {**result.summary, "task": task, "output_width": width},
                                        result.gradients.to_dict("records"))
        fitted._resetUid(self.uid.replace("TorchEstimator", "TorchModel"))
        for name in MODEL_PARAMS:
            if self.isDefined(name):
                fitted._set(**{name: self.getOrDefault(name)})
        return fitted

    def write(self) -> TorchWriter:
        return TorchWriter(self)

    @classmethod
    def read(cls) -> TorchReader:
        return TorchReader(cls)


add_accessors(TorchEstimator, ESTIMATOR_PARAMS)
