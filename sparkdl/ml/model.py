"""TorchModel: a fitted network that scores DataFrames on the executors."""
from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
import torch
from pyspark import keyword_only
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T
from torch import nn

from sparkdl._internal.data.partitions import Padding
from sparkdl._internal.data.schema import validate_columns
from sparkdl._internal.spark.backend import backend_for
from sparkdl._internal.training.pipeline_cuts import whole_model
from sparkdl.ml._column_function import column_function, has_arrow_udf, scored_frame
from sparkdl.ml._connect_io import ConnectAwareReader, ConnectAwareWriter, read_file_bytes
from sparkdl.ml._model_sources import ModuleTemplate, SavedProgram, carries_weights
from sparkdl.ml._outputs import OUTPUT_KINDS, OutputSpec, prediction_task
from sparkdl.ml._params import MODEL_PARAMS, TorchModelParams, add_accessors
from sparkdl.ml._persistence import state_from_bytes, state_to_bytes
from sparkdl.ml._scoring import HANDLE_INVALID, ScoringSpec, SharedModels, make_scorer

__all__ = ["TorchModel"]


def _require_output_kind(kind: str) -> None:
    """A model not fitted here has no loss to read its output kind from: it must be named."""
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"outputKind must be one of {', '.join(map(repr, OUTPUT_KINDS))} for a model not fitted "
                         f"here (there is no loss to read it from), got {kind!r}")


def _cpu_copy(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def _checked_state(factory: Callable[[], nn.Module], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` on the CPU, once it is known to fit the factory's module (a clear error here, not on executors)."""
    try:
        whole_model(factory).load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"the state dict does not fit the module the factory builds: {exc}") from None
    return _cpu_copy(state)


class TorchModel(Model, TorchModelParams, MLWritable, MLReadable):
    """A network that scores DataFrames; ``transform`` adds ``predictionCol`` (and ``probabilityCol`` for
    classifiers, and what ``rawPredictionCol``, ``topK`` and ``outputCols`` ask for).

    A ``TorchEstimator`` fits one; :meth:`from_module` wraps a module trained anywhere and :meth:`load_torch`
    a TorchScript or ``torch.export`` file.

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
                 featuresShape: list[int] | None = None, inputCols: list[str] | None = None,
                 inputArgs: list[str] | None = None, inputShapes: dict[str, list[int]] | None = None,
                 predictionCol: str | None = None, probabilityCol: str | None = None,
                 rawPredictionCol: str | None = None, outputKind: str | None = None, topK: int | None = None,
                 topKCol: str | None = None, outputCols: list[str] | None = None, device: str | None = None,
                 inferenceBatchSize: int | None = None, handleInvalid: str | None = None,
                 batchTransform: Any = None, padValue: int | None = None,
                 sequenceLength: int | None = None) -> None:
        super().__init__()
        self.state_dict: dict[str, torch.Tensor] | None = None
        self._history_records: list[dict[str, Any]] | None = None
        self._summary: dict[str, Any] | None = None
        self._gradient_records: list[dict[str, Any]] | None = None
        # the model as this model and its copies last shipped it to a session: later scorings reuse it
        self._shared_models = SharedModels()
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

    # ----------------------------------------------------------------- models from anywhere
    @classmethod
    def from_module(cls, module: nn.Module | Callable[[], nn.Module], *, outputKind: str,
                    state_dict: Mapping[str, torch.Tensor] | str | os.PathLike[str] | None = None,
                    **params: Any) -> TorchModel:
        """A model that scores with ``module``, trained anywhere.

        ``module`` is an ``nn.Module`` (its weights are copied now: later changes to it do not reach this
        model), or a zero-argument factory of one with ``state_dict`` (a dict, or the path of a
        ``torch.save``'d one, local or on any Hadoop-compatible file system); a factory without a state dict
        is built once here and its initial weights (pretrained ones it loads, say) are the ones every worker
        scores with.  ``outputKind`` says what the output is (see :data:`OUTPUT_KINDS`); ``params`` are any
        of the model's Params (``featuresCol``, ``inputCols``, ``featuresShape``, ``topK`` ...).
        """
        _require_output_kind(outputKind)
        if isinstance(module, nn.Module) and state_dict is not None:
            raise ValueError("a module carries its own weights: give state_dict with a factory of the module instead")
        if isinstance(module, torch.jit.ScriptModule):   # its code is in the module: saved as TorchScript
            buffer = io.BytesIO()
            torch.jit.save(module, buffer)
            program = SavedProgram(buffer.getvalue(), "torchscript")
            return cls._from_saved(None, None, None)._with(model=program, outputKind=outputKind, **params)
        if isinstance(module, nn.Module):
            factory: Callable[[], nn.Module] = ModuleTemplate(module)
            state = _cpu_copy(module.state_dict())
        elif callable(module):
            factory = module
            if state_dict is None:   # built once, here: every worker gets these weights, and none builds it again
                built = whole_model(factory)
                factory, state = ModuleTemplate(built), _cpu_copy(built.state_dict())
            elif isinstance(state_dict, str | os.PathLike):
                state = _checked_state(factory, state_from_bytes(read_file_bytes(os.fspath(state_dict))))
            else:
                state = _checked_state(factory, state_dict)
        else:
            raise TypeError(f"from_module takes an nn.Module or a zero-argument factory of one, got "
                            f"{type(module).__name__}")
        return cls._from_saved(state, None, None)._with(model=factory, outputKind=outputKind, **params)

    @classmethod
    def load_torch(cls, path: str | os.PathLike[str], *, outputKind: str, **params: Any) -> TorchModel:
        """A model that scores with the TorchScript module (``torch.jit.save``) or ``torch.export`` program
        (``torch.export.save``, exported with a dynamic batch dimension) at ``path``, local or on any
        Hadoop-compatible file system.  ``outputKind`` and ``params`` as in :meth:`from_module`."""
        _require_output_kind(outputKind)
        program = SavedProgram(read_file_bytes(os.fspath(path)))
        program.check()
        return cls._from_saved(None, None, None)._with(model=program, outputKind=outputKind, **params)

    def _with(self, **params: Any) -> TorchModel:
        """Set Params by name, refusing a name that is not one of the model's."""
        unknown = sorted(set(params) - set(MODEL_PARAMS))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not Params of TorchModel; it has {', '.join(MODEL_PARAMS)}")
        return self._set(**params)

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
        """The network with its weights, on CPU, in eval mode (a ``torch.export`` program: as exported)."""
        if carries_weights(self.getModel()):
            return self.getModel()()         # a saved program: scores as it was saved
        module = whole_model(self.getModel())
        module.load_state_dict(self.state_dict)  # type: ignore[arg-type]  # None (no weights): torch's TypeError
        return module.eval()

    # ----------------------------------------------------------------- scoring
    def _task(self) -> str:
        """The output kind: ``outputKind``, or with "auto" what the fitted loss implies."""
        kind = self.getOutputKind()
        if kind != "auto":
            return kind
        summary = self._summary or {}
        if "task" in summary:
            return summary["task"]
        return prediction_task(self.getLoss(), int(summary.get("output_width", 1)))

    def output_spec(self) -> OutputSpec:
        """The columns ``transform`` adds, as the output Params say (checked)."""
        return OutputSpec(self._task(), self.getPredictionCol(), self.getProbabilityCol() or None,
                          self.getRawPredictionCol() or None, self.getTopK(), self.getTopKCol(),
                          tuple(self.getOutputCols() or ()))

    def _scoring_spec(self, dataset: DataFrame | None) -> ScoringSpec:
        """What the executors need to score ``dataset`` (its columns checked against the Params; None: the
        columns a SQL function is called with, checked as they arrive)."""
        if self.state_dict is None and not carries_weights(self.getModel()):
            raise ValueError("this TorchModel has no weights; fit a TorchEstimator, load a saved model, or build "
                             "one with TorchModel.from_module or TorchModel.load_torch")
        columns = self.column_spec(with_label=False)
        if self.getHandleInvalid() not in HANDLE_INVALID:
            raise ValueError(f"handleInvalid must be one of {', '.join(map(repr, HANDLE_INVALID))}, "
                             f"got {self.getHandleInvalid()!r}")
        if dataset is not None:
            validate_columns(dataset, columns, decoder=self.getBatchTransform() is not None)
        outputs = self.output_spec()
        taken = set(dataset.columns if dataset is not None else ())
        for name in outputs.names:
            if name in taken:
                raise ValueError(f"output column {name!r} already exists in the DataFrame (or is named twice); set "
                                 "predictionCol/probabilityCol/rawPredictionCol/topKCol/outputCols to other names")
            taken.add(name)
        state = b"" if self.state_dict is None else state_to_bytes(self.state_dict)
        return ScoringSpec(self.getModel(), state, columns, outputs, self.getDevice(), self.getInferenceBatchSize(),
                           batch_transform=self.getBatchTransform(), handle_invalid=self.getHandleInvalid(),
                           padding=Padding(self.getOrDefault("padValue"), self.getOrDefault("sequenceLength")),
                           precision=self.getOrDefault("precision"))

    def _shared(self) -> SharedModels:
        """What this model and its copies shipped to a session (a model unpickled from an older release has none)."""
        if getattr(self, "_shared_models", None) is None:
            self._shared_models = SharedModels()
        return self._shared_models

    def _transform(self, dataset: DataFrame) -> DataFrame:
        spec = self._scoring_spec(dataset)
        backend = backend_for(dataset.sparkSession)
        if has_arrow_udf():
            return scored_frame(dataset, spec, backend, self._shared())
        schema = T.StructType(list(dataset.schema.fields) + spec.outputs.fields())
        return dataset.mapInArrow(make_scorer(spec, backend, self._shared()), schema)

    def udf(self, spark: SparkSession | None = None) -> Any:
        """The model as a column function of its input columns, for ``withColumn``, ``select`` and, after
        ``spark.udf.register(name, model.udf())``, Spark SQL; it returns what :meth:`transform` adds (one column
        as its value, several as a struct).  Invalid rows give null (``handleInvalid="keep"``) or fail the query
        ("error"); "skip" is refused.  ``spark``: the session it will run in (default: the active one).
        Needs pyspark 4.1 or newer."""
        session = spark or SparkSession.getActiveSession()
        if session is None:
            raise RuntimeError("TorchModel.udf() needs a SparkSession: start one first, or pass it as udf(spark)")
        return column_function(self._scoring_spec(None), backend_for(session), self._shared())

    def write(self) -> ConnectAwareWriter:
        """A writer for this instance (classic or Spark Connect session)."""
        return ConnectAwareWriter(self)

    @classmethod
    def read(cls) -> ConnectAwareReader:
        """A reader of saved instances (classic or Spark Connect session)."""
        return ConnectAwareReader(cls)


add_accessors(TorchModel, MODEL_PARAMS)
