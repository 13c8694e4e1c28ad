"""pyspark.ml Params of TorchEstimator / TorchModel, and their mapping onto TrainConfig."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (
    HasFeaturesCol,
    HasLabelCol,
    HasPredictionCol,
    HasProbabilityCol,
    HasSeed,
    HasWeightCol,
)

from sparkdl._internal.data.columns import ColumnSpec
from sparkdl.config import Setting, TrainConfig, settings, validate_setting


def _identity(value: Any) -> Any:
    return value


def _to_string(value: Any) -> str:
    # paths given as pathlib.Path are settings like any other string
    return TypeConverters.toString(os.fspath(value) if isinstance(value, os.PathLike) else value)


@dataclass(frozen=True)
class _Checked:
    """A Param converter that also applies the field's rule, so that a bad value is refused when it is set.

    It refuses with TrainConfig's message (``validate_setting``); a class, not a closure, so that
    Params pickle.
    """

    name: str
    convert: Callable[[Any], Any]

    def __call__(self, value: Any) -> Any:
        return validate_setting(_SETTINGS_BY_NAME[self.name], self.convert(value), given=value)


@dataclass(frozen=True)
class _Optional:
    """A Param converter that lets None through (a class, not a closure, so that Params pickle)."""

    convert: Callable[[Any], Any]

    def __call__(self, value: Any) -> Any:
        return None if value is None else self.convert(value)


def _optional_int_list(value: Any) -> list[int] | None:
    return None if value is None else [int(v) for v in TypeConverters.toList(value)]


def _shapes_by_column(value: Any) -> dict[str, list[int]]:
    """``inputShapes``: {column: row shape}, e.g. {"image": [1, 28, 28]}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"inputShapes must be a dict of column name -> row shape, got {type(value).__name__}")
    return {str(name): [int(v) for v in TypeConverters.toList(shape)] for name, shape in value.items()}


_CONVERTERS: dict[type, Callable[[Any], Any]] = {bool: TypeConverters.toBoolean, int: TypeConverters.toInt,
                                                 float: TypeConverters.toFloat, str: _to_string}

#: TrainConfig fields exposed as Params, and the subset the fitted TorchModel has too
#: (every one has a Param name: ``cast(str, spec.param)`` below says so where a str is needed)
PARAM_SETTINGS: tuple[Setting, ...] = tuple(spec for spec in settings() if spec.param)
_SETTINGS_BY_NAME: dict[str, Setting] = {spec.name: spec for spec in settings()}
SCORING_SETTINGS: tuple[Setting, ...] = tuple(spec for spec in PARAM_SETTINGS if spec.scoring)


def setting_param(spec: Setting) -> Param:
    """The pyspark.ml Param of one TrainConfig field; its converter follows the field's type and rule."""
    # the loss may be a callable
    convert = _Checked(spec.name, _CONVERTERS[spec.value_type] if spec.value_type else _identity)
    return Param(Params._dummy(), cast(str, spec.param), spec.describe(),
                 typeConverter=_Optional(convert) if spec.optional else convert)


def _add_setting_params(cls: type, specs: tuple[Setting, ...]) -> None:
    # pyspark finds Params as class attributes, so they must be in place before any instance exists;
    # one a base class already declares (HasSeed's seed) is kept as it is
    for spec in specs:
        if not isinstance(getattr(cls, cast(str, spec.param), None), Param):
            setattr(cls, cast(str, spec.param), setting_param(spec))


class HasFeaturesCols(Params):
    featuresCols = Param(Params._dummy(), "featuresCols",
                         "numeric columns assembled into the features (instead of featuresCol)",
                         typeConverter=TypeConverters.toListString)

    def getFeaturesCols(self) -> list[str]:
        return self.getOrDefault(self.featuresCols)


class HasInputCols(Params):
    inputCols = Param(Params._dummy(), "inputCols",
                      "columns that reach the model as separate inputs, each in its own dtype: model(*inputs) in this "
                      "order, or keyword arguments with inputArgs (instead of featuresCol/featuresCols)",
                      typeConverter=TypeConverters.toListString)
    inputArgs = Param(Params._dummy(), "inputArgs",
                      "forward's argument names, one per input column: the inputs go as keyword arguments, and a "
                      "ragged input's mask as <arg>_mask where forward takes it",
                      typeConverter=TypeConverters.toListString)
    inputShapes = Param(Params._dummy(), "inputShapes",
                        "row shapes of input columns, as {column: shape}, e.g. {'image': [1, 28, 28]}",
                        typeConverter=_shapes_by_column)

    def getInputCols(self) -> list[str]:
        return self.getOrDefault(self.inputCols)

    def getInputArgs(self) -> list[str]:
        return self.getOrDefault(self.inputArgs)

    def getInputShapes(self) -> dict[str, list[int]]:
        return self.getOrDefault(self.inputShapes)


class TorchModelParams(HasFeaturesCol, HasFeaturesCols, HasInputCols, HasPredictionCol, HasProbabilityCol):
    """Params shared by the estimator and the fitted model (how to read features and score).

    ``loss`` and ``device`` come from the settings table (``TrainConfig`` fields marked ``scoring``).
    """

    # set on the class by _add_setting_params below (declared here for the type checker only)
    loss: Param[Any]
    device: Param[Any]

    model = Param(Params._dummy(), "model", "zero-argument callable returning the torch.nn.Module",
                  typeConverter=_identity)
    featuresShape = Param(Params._dummy(), "featuresShape",
                          "shape of one feature row for the model, e.g. [1, 28, 28] (default: flat)",
                          typeConverter=_optional_int_list)
    inferenceBatchSize = Param(Params._dummy(), "inferenceBatchSize", "rows per forward pass in transform",
                               typeConverter=TypeConverters.toInt)
    outputKind = Param(Params._dummy(), "outputKind",
                       "what the model's output is: 'auto' (what the fitted loss implies), 'multiclass' (class "
                       "logits: prediction and probability), 'binary' (one logit), 'multilabel' (a logit per label), "
                       "'regression' (one number), 'multioutput' (several numbers, a Vector) or 'embedding' (the "
                       "output as array<float>)", typeConverter=TypeConverters.toString)
    rawPredictionCol = Param(Params._dummy(), "rawPredictionCol",
                             "column of the model's raw output as a Vector (empty: not added)",
                             typeConverter=TypeConverters.toString)
    topK = Param(Params._dummy(), "topK", "'multiclass' and 'multilabel': add the k likeliest classes, likeliest "
                 "first, as array<int> in topKCol (0: not added)", typeConverter=TypeConverters.toInt)
    topKCol = Param(Params._dummy(), "topKCol", "column of the top-k classes", typeConverter=TypeConverters.toString)
    outputCols = Param(Params._dummy(), "outputCols",
                       "'embedding' models with several outputs (a tuple or list, or a dict by key): one array<float> "
                       "column per output, named here", typeConverter=TypeConverters.toListString)
    handleInvalid = Param(Params._dummy(), "handleInvalid",
                          "rows that transform gets with null, NaN or infinite features: 'error' (fail, naming "
                          "the row), 'skip' (leave them out of the output) or 'keep' (prediction NaN, "
                          "probability null); fit always refuses them", typeConverter=TypeConverters.toString)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(model=None, featuresCol="features", featuresCols=[], featuresShape=None, inputCols=[],
                         inputArgs=[], inputShapes={},
                         predictionCol="prediction", probabilityCol="probability", inferenceBatchSize=1024,
                         handleInvalid="error", outputKind="auto", rawPredictionCol="", topK=0, topKCol="topK",
                         outputCols=[],
                         **{cast(str, spec.param): spec.default for spec in SCORING_SETTINGS})

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

    def getHandleInvalid(self) -> str:
        return self.getOrDefault(self.handleInvalid)

    def getOutputKind(self) -> str:
        return self.getOrDefault(self.outputKind)

    def getRawPredictionCol(self) -> str:
        return self.getOrDefault(self.rawPredictionCol)

    def getTopK(self) -> int:
        return self.getOrDefault(self.topK)

    def getTopKCol(self) -> str:
        return self.getOrDefault(self.topKCol)

    def getOutputCols(self) -> list[str]:
        return self.getOrDefault(self.outputCols)

    def column_spec(self, with_label: bool) -> ColumnSpec:
        """The columns the model reads (``with_label``: and the label and weight columns, for fitting)."""
        shape = self.getFeaturesShape()
        cols = tuple(self.getFeaturesCols() or ())
        inputs = tuple(self.getInputCols() or ())
        shapes = self.getInputShapes() or {}
        unknown = sorted(set(shapes) - set(inputs))
        if unknown:
            raise ValueError(f"inputShapes names {unknown}, which are not among inputCols {list(inputs)}")
        weight = self.getOrDefault("weightCol") if with_label and self.hasParam("weightCol") else None
        return ColumnSpec(features_col=None if cols or inputs else self.getFeaturesCol(), features_cols=cols,
                          label_col=self.getOrDefault("labelCol") if with_label and self.hasParam("labelCol") else None,
                          features_shape=tuple(shape) if shape else None, input_cols=inputs,
                          input_shapes=tuple(tuple(shapes[c]) if c in shapes else None for c in inputs) if shapes else (),
                          weight_col=weight or None, input_args=tuple(self.getInputArgs() or ()))


_add_setting_params(TorchModelParams, SCORING_SETTINGS)


class TorchEstimatorParams(TorchModelParams, HasLabelCol, HasWeightCol, HasSeed):
    """Training Params, one per ``TrainConfig`` field (see ``sparkdl.config``), plus ``labelCol``.

    :meth:`train_config` and :meth:`set_train_config` map them onto the core's ``TrainConfig``
    and back.
    """

    def __init__(self) -> None:
        super().__init__()
        # a tuple default as a list (pyspark's explainParams formats a default with %, which takes a tuple apart)
        self._setDefault(labelCol="label", weightCol="", **{cast(str, spec.param): list(spec.default)
                                                            if isinstance(spec.default, tuple) else spec.default
                                                            for spec in PARAM_SETTINGS})

    def train_config(self) -> TrainConfig:
        """The training configuration these Params describe (validated)."""
        return TrainConfig(**{spec.name: self.getOrDefault(cast(str, spec.param)) for spec in PARAM_SETTINGS})

    def set_train_config(self, config: TrainConfig) -> TorchEstimatorParams:
        """Set every training Param from ``config``; refuses a config whose internal fields are not defaults."""
        for spec in settings():
            if spec.internal and getattr(config, spec.name) != spec.default:
                raise ValueError(f"TrainConfig.{spec.name} cannot be set through Params ({spec.internal})")
        return self._set(**{cast(str, spec.param): getattr(config, spec.name) for spec in PARAM_SETTINGS})


_add_setting_params(TorchEstimatorParams, PARAM_SETTINGS)


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


#: the Params that say which columns scoring adds besides predictionCol and probabilityCol
OUTPUT_PARAMS = ["outputKind", "rawPredictionCol", "topK", "topKCol", "outputCols"]
ESTIMATOR_PARAMS = ["model", "featuresCol", "featuresCols", "featuresShape", "inputCols", "inputArgs", "inputShapes",
                    "labelCol", "weightCol", "predictionCol",
                    "probabilityCol", *OUTPUT_PARAMS, "inferenceBatchSize", "handleInvalid",
                    *(cast(str, spec.param) for spec in PARAM_SETTINGS)]
MODEL_PARAMS = ["model", "featuresCol", "featuresCols", "featuresShape", "inputCols", "inputArgs", "inputShapes",
                "predictionCol", "probabilityCol", *OUTPUT_PARAMS,
                "inferenceBatchSize", "handleInvalid", *(cast(str, spec.param) for spec in SCORING_SETTINGS)]
add_accessors(TorchEstimatorParams, ESTIMATOR_PARAMS, setters=False)
