"""pyspark.ml Params of TorchEstimator / TorchModel, and their mapping onto TrainConfig."""
from __future__ import annotations

from typing import Any, Callable

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (HasFeaturesCol, HasLabelCol, HasPredictionCol, HasProbabilityCol,
                                     HasSeed)

from ..config import TrainConfig
from ..runtime.columns import ColumnSpec


def _identity(value: Any) -> Any:
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else TypeConverters.toInt(value)


def _optional_int_list(value: Any) -> list[int] | None:
    return None if value is None else [int(v) for v in TypeConverters.toList(value)]


def _optional_string(value: Any) -> str | None:
    return None if value is None else TypeConverters.toString(value)


class HasFeaturesCols(Params):
    featuresCols = Param(Params._dummy(), "featuresCols",
                         "numeric columns assembled into the features (instead of featuresCol)",
                         typeConverter=TypeConverters.toListString)

    def getFeaturesCols(self) -> list[str]:
        return self.getOrDefault(self.featuresCols)


class TorchModelParams(HasFeaturesCol, HasFeaturesCols, HasPredictionCol, HasProbabilityCol):
    """Params shared by the estimator and the fitted model (how to read features and score)."""

    model = Param(Params._dummy(), "model", "zero-argument callable returning the torch.nn.Module",
                  typeConverter=_identity)
    loss = Param(Params._dummy(), "loss",
                 "'cross_entropy', 'mse', 'bce_with_logits' or a callable loss(output, target)",
                 typeConverter=_identity)
    featuresShape = Param(Params._dummy(), "featuresShape",
                          "shape of one feature row for the model, e.g. [1, 28, 28] (default: flat)",
                          typeConverter=_optional_int_list)
    device = Param(Params._dummy(), "device", "'auto' (Spark-assigned GPU, else CPU), 'cpu' or 'cuda'",
                   typeConverter=TypeConverters.toString)
    inferenceBatchSize = Param(Params._dummy(), "inferenceBatchSize", "rows per forward pass in transform",
                               typeConverter=TypeConverters.toInt)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(model=None, loss="cross_entropy", featuresCol="features", featuresCols=[],
                         featuresShape=None, predictionCol="prediction", probabilityCol="probability",
                         device="auto", inferenceBatchSize=1024)

    def getModel(self) -> Callable[[], Any]:
        return self.getOrDefault(self.model)

    def getLoss(self) -> Any:
        return self.getOrDefault(self.loss)

    def getFeaturesShape(self) -> list[int] | None:
        return self.getOrDefault(self.featuresShape)

    def getDevice(self) -> str:
        return self.getOrDefault(self.device)

    def getInferenceBatchSize(self) -> int:
        return self.getOrDefault(self.inferenceBatchSize)

    def column_spec(self, with_label: bool) -> ColumnSpec:
        shape = self.getFeaturesShape()
        cols = tuple(self.getFeaturesCols() or ())
        return ColumnSpec(features_col=None if cols else self.getFeaturesCol(), features_cols=cols,
                          label_col=self.getOrDefault("labelCol") if with_label and self.hasParam("labelCol") else None,
                          features_shape=tuple(shape) if shape else None)


class TorchEstimatorParams(TorchModelParams, HasLabelCol, HasSeed):
    """Training Params; :meth:`train_config` maps them onto the core's TrainConfig."""

    optimizer = Param(Params._dummy(), "optimizer", "'sgd' or 'adam' (applied on the parameter server)",
                      typeConverter=TypeConverters.toString)
    learningRate = Param(Params._dummy(), "learningRate", "base learning rate alpha0",
                         typeConverter=TypeConverters.toFloat)
    momentum = Param(Params._dummy(), "momentum", "SGD momentum", typeConverter=TypeConverters.toFloat)
    weightDecay = Param(Params._dummy(), "weightDecay", "L2 weight decay", typeConverter=TypeConverters.toFloat)
    batchSize = Param(Params._dummy(), "batchSize", "mini-batch size per worker", typeConverter=TypeConverters.toInt)
    epochs = Param(Params._dummy(), "epochs", "passes over the data", typeConverter=TypeConverters.toInt)
    numWorkers = Param(Params._dummy(), "numWorkers", "model replicas (barrier tasks)",
                       typeConverter=TypeConverters.toInt)
    updatePolicy = Param(Params._dummy(), "updatePolicy", "'sync', 'async' or 'softsync'",
                         typeConverter=TypeConverters.toString)
    softsyncSize = Param(Params._dummy(), "softsyncSize", "softsync: gradients per update (1..numWorkers)",
                         typeConverter=TypeConverters.toInt)
    localSteps = Param(Params._dummy(), "localSteps", "mini-batches averaged locally before one push",
                       typeConverter=TypeConverters.toInt)
    stalenessLr = Param(Params._dummy(), "stalenessLr", "'none' or 'inverse' (alpha0/tau for staleness tau >= 1)",
                        typeConverter=TypeConverters.toString)
    maxStaleness = Param(Params._dummy(), "maxStaleness", "drop gradients staler than this (None: no bound)",
                         typeConverter=_optional_int)
    compression = Param(Params._dummy(), "compression",
                        "gradient compression: 'none', 'fp16', 'int8' or 'topk' (with error feedback)",
                        typeConverter=TypeConverters.toString)
    topkRatio = Param(Params._dummy(), "topkRatio", "topk: fraction of gradient entries pushed",
                      typeConverter=TypeConverters.toFloat)
    checkpointDir = Param(Params._dummy(), "checkpointDir",
                          "directory for parameter-server checkpoints (None: no checkpoints)",
                          typeConverter=_optional_string)
    checkpointEvery = Param(Params._dummy(), "checkpointEvery", "updates between two checkpoints",
                            typeConverter=TypeConverters.toInt)
    resumeFrom = Param(Params._dummy(), "resumeFrom",
                       "checkpoint directory to resume from (newest complete checkpoint; None: start fresh)",
                       typeConverter=_optional_string)
    maxAttempts = Param(Params._dummy(), "maxAttempts", "barrier-stage attempts before the run fails",
                        typeConverter=TypeConverters.toInt)
    nonfinite = Param(Params._dummy(), "nonfinite", "NaN/Inf gradients: 'skip' (refuse and count) or 'fail'",
                      typeConverter=TypeConverters.toString)
    verbose = Param(Params._dummy(), "verbose", "show a live progress bar on the driver while training",
                    typeConverter=TypeConverters.toBoolean)
    timeout = Param(Params._dummy(), "timeout", "seconds any blocking wait may take before the run fails",
                    typeConverter=TypeConverters.toFloat)

    def __init__(self) -> None:
        super().__init__()
        defaults = TrainConfig()
        self._setDefault(labelCol="label", optimizer=defaults.optimizer, learningRate=defaults.learning_rate,
                         momentum=defaults.momentum, weightDecay=defaults.weight_decay,
                         batchSize=defaults.batch_size, epochs=defaults.epochs, numWorkers=defaults.num_workers,
                         updatePolicy=defaults.policy, softsyncSize=defaults.softsync_size,
                         localSteps=defaults.local_steps, stalenessLr=defaults.staleness_lr,
                         maxStaleness=defaults.max_staleness, seed=defaults.seed,
                         compression=defaults.compression, topkRatio=defaults.topk_ratio,
                         checkpointDir=defaults.checkpoint_dir, checkpointEvery=defaults.checkpoint_every,
                         resumeFrom=defaults.resume_from, maxAttempts=defaults.max_attempts,
                         nonfinite=defaults.nonfinite, verbose=defaults.verbose, timeout=defaults.timeout_s)

    def train_config(self) -> TrainConfig:
        """The one place where Params become the core's configuration."""
        get = self.getOrDefault
        return TrainConfig(
            num_workers=get(self.numWorkers), epochs=get(self.epochs), batch_size=get(self.batchSize),
            policy=get(self.updatePolicy), softsync_size=get(self.softsyncSize), local_steps=get(self.localSteps),
            staleness_lr=get(self.stalenessLr), max_staleness=get(self.maxStaleness), optimizer=get(self.optimizer),
            learning_rate=get(self.learningRate), momentum=get(self.momentum), weight_decay=get(self.weightDecay),
            loss=get(self.loss), seed=get(self.seed), timeout_s=get(self.timeout), device=get(self.device),
            checkpoint_dir=get(self.checkpointDir), checkpoint_every=get(self.checkpointEvery),
            resume_from=get(self.resumeFrom), max_attempts=get(self.maxAttempts), nonfinite=get(self.nonfinite),
            verbose=get(self.verbose), compression=get(self.compression), topk_ratio=get(self.topkRatio))


def _accessor_name(param: str) -> str:
    return param[0].upper() + param[1:]


def add_accessors(cls: type, names: list[str], setters: bool = True) -> type:
    """Give ``cls`` pyspark-style ``getX`` (and ``setX``) methods for the named Params.

    pyspark.ml writes these one by one; generating them keeps the long Param list in one
    place without changing how they behave.
    """
    for name in names:
        accessor = _accessor_name(name)
        if not hasattr(cls, f"get{accessor}"):
            def getter(self, _name=name):
                return self.getOrDefault(_name)
            getter.__name__ = f"get{accessor}"
            getter.__doc__ = f"Gets the value of {name} or its default."
            setattr(cls, getter.__name__, getter)
        if setters and not hasattr(cls, f"set{accessor}"):
            def setter(self, value, _name=name):
                return self._set(**{_name: value})
            setter.__name__ = f"set{accessor}"
            setter.__doc__ = f"Sets the value of {name}."
            setattr(cls, setter.__name__, setter)
    return cls


ESTIMATOR_PARAMS = ["model", "loss", "optimizer", "learningRate", "momentum", "weightDecay", "batchSize", "epochs",
                    "numWorkers", "updatePolicy", "softsyncSize", "localSteps", "stalenessLr", "maxStaleness",
                    "seed", "featuresCol", "featuresCols", "featuresShape", "labelCol", "predictionCol",
                    "probabilityCol", "compression", "topkRatio", "checkpointDir", "checkpointEvery", "resumeFrom",
                    "maxAttempts", "nonfinite", "verbose", "device", "timeout", "inferenceBatchSize"]
MODEL_PARAMS = ["model", "loss", "featuresCol", "featuresCols", "featuresShape", "predictionCol", "probabilityCol",
                "device", "inferenceBatchSize"]
add_accessors(TorchEstimatorParams, ESTIMATOR_PARAMS, setters=False)
