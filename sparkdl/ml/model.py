"""TorchModel: a fitted network that scores DataFrames on the executors."""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from pyspark import keyword_only
from pyspark.ml import Model
from pyspark.ml.linalg import VectorUDT
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame
from pyspark.sql import types as T
from torch import nn

from sparkdl._internal.data.partitions import Padding
from sparkdl._internal.data.schema import validate_columns
from sparkdl._internal.spark.backend import backend_for
from sparkdl._internal.training.pipeline_cuts import whole_model
from sparkdl.ml._connect_io import ConnectAwareReader, ConnectAwareWriter
from sparkdl.ml._params import MODEL_PARAMS, TorchModelParams, add_accessors
from sparkdl.ml._persistence import state_to_bytes
from sparkdl.ml._scoring import HANDLE_INVALID, ScoringSpec, make_scorer

__all__ = ["TorchModel"]

#: tasks whose prediction is a Vector (one value per output), not one number
VECTOR_TASKS = ("multilabel", "multioutput")


def prediction_task(loss: Any, output_width: int) -> str:
    """How outputs become predictions: "multiclass", "binary", "multilabel" (bce_with_logits with several
    outputs), "regression" or "multioutput" (mse with several outputs)."""
    if loss == "cross_entropy":
        return "multiclass"
    if loss == "bce_with_logits":
        return "multilabel" if output_width > 1 else "binary"
    if loss == "mse":
        return "multioutput" if output_width > 1 else "regression"
    return "multiclass" if output_width > 1 else "regression"


class TorchModel(Model, TorchModelParams, MLWritable, MLReadable):
    """A trained network; ``transform`` adds ``predictionCol`` (and ``probabilityCol`` for classifiers).

    Scoring runs on the executors over Arrow batches: the weights travel once per executor in
    a broadcast (inside the query plan under Spark Connect), each Python worker builds the
    model once, under ``torch.inference_mode`` and on its Spark-assigned GPU when there is one.
    Nothing is collected to the driver.  Rows with null, NaN or infinite features fail the
    transform by default; ``handleInvalid`` ("skip", "keep") leaves them out or unpredicted, as
    Spark ML's own transformers do.
    """

    # declared for the type checker only: set by @keyword_only, and made by add_accessors below
    _input_kwargs: dict[str, Any]
    getBatchTransform: Callable[[], Any]

    @keyword_only
    def __init__(self, *, model: Callable[[], nn.Module] | None = None, loss: Any = None,
                 featuresCol: str | None = None, featuresCols: list[str] | None = None,
                 featuresShape: list[int] | None = None, predictionCol: str | None = None,
                 probabilityCol: str | None = None, device: str | None = None,
                 inferenceBatchSize: int | None = None, handleInvalid: str | None = None,
                 batchTransform: Any = None) -> None:
        super().__init__()
        self.state_dict: dict[str, torch.Tensor] | None = None
        self._history_records: list[dict[str, Any]] | None = None
        self._summary: dict[str, Any] | None = None
        self._gradient_records: list[dict[str, Any]] | None = None
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        self._set(**kwargs)

    @classmethod
    def _from_saved(cls, state: dict[str, torch.Tensor] | None, history: list[dict[str, Any]] | None,
                    summary: dict[str, Any] | None, gradients: list[dict[str, Any]] | None = None) -> TorchModel:
        instance = cls()
        instance.state_dict = state
        instance._history_records = history
        instance._summary = summary
        instance._gradient_records = gradients
        return instance

    # ----------------------------------------------------------------- results of training
    @property
    def history(self) -> pd.DataFrame:
        """One row per parameter-server update: version, time_s, epoch, loss, samples, staleness ..."""
        return pd.DataFrame(self._history_records or [])

    @property
    def gradients(self) -> pd.DataFrame:
        """One row per pushed gradient: time_s, worker, epoch, computed_on, staleness, accepted."""
        return pd.DataFrame(self._gradient_records or [])

    @property
    def summary(self) -> dict[str, Any]:
        """Final figures of the training run (updates, samples/s, staleness, loss, seconds ...)."""
        return dict(self._summary or {})

    def torch_module(self) -> nn.Module:
        """The network with the trained weights, on CPU, in eval mode."""
        module = whole_model(self.getModel())
        module.load_state_dict(self.state_dict)  # type: ignore[arg-type]  # None (no weights): torch's TypeError
        return module.eval()

    # ----------------------------------------------------------------- scoring
    def _task(self) -> str:
        summary = self._summary or {}
        if "task" in summary:
            return summary["task"]
        return prediction_task(self.getLoss(), int(summary.get("output_width", 1)))

    def _transform(self, dataset: DataFrame) -> DataFrame:
        if self.state_dict is None:
            raise ValueError("this TorchModel has no weights; fit a TorchEstimator or load a saved model")
        columns = self.column_spec(with_label=False)
        if self.getHandleInvalid() not in HANDLE_INVALID:
            raise ValueError(f"handleInvalid must be one of {', '.join(map(repr, HANDLE_INVALID))}, "
                             f"got {self.getHandleInvalid()!r}")
        validate_columns(dataset, columns, decoder=self.getBatchTransform() is not None)
        task = self._task()
        scores = task not in ("regression", "multioutput")
        probability_col = self.getProbabilityCol() if scores and self.getProbabilityCol() else None
        names = set(dataset.columns)
        for name in filter(None, (self.getPredictionCol(), probability_col)):
            if name in names:
                raise ValueError(f"output column {name!r} already exists in the DataFrame; set predictionCol/"
                                 "probabilityCol to another name")
        spec = ScoringSpec(self.getModel(), state_to_bytes(self.state_dict), columns, task, self.getDevice(),
                           self.getInferenceBatchSize(), self.getPredictionCol(), probability_col,
                           key=uuid.uuid4().hex, batch_transform=self.getBatchTransform(),
                           handle_invalid=self.getHandleInvalid(),
                           padding=Padding(self.getOrDefault("padValue"), self.getOrDefault("sequenceLength")))
        predicted = VectorUDT() if task in VECTOR_TASKS else T.DoubleType()
        fields = list(dataset.schema.fields) + [T.StructField(self.getPredictionCol(), predicted,
                                                              task in VECTOR_TASKS)]
        if probability_col:
            fields.append(T.StructField(probability_col, VectorUDT(), True))
        return dataset.mapInArrow(make_scorer(spec, backend_for(dataset.sparkSession)), T.StructType(fields))

    def write(self) -> ConnectAwareWriter:
        """A writer for this instance (classic or Spark Connect session)."""
        return ConnectAwareWriter(self)

    @classmethod
    def read(cls) -> ConnectAwareReader:
        """A reader of saved instances (classic or Spark Connect session)."""
        return ConnectAwareReader(cls)


add_accessors(TorchModel, MODEL_PARAMS)
