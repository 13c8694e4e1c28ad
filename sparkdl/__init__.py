"""sparkdl: data-parallel PyTorch training inside Apache Spark, with a parameter server.

The Spark-facing names are imported on first use, so ``sparkdl.config`` (and the parameter server
inside) load without pyspark.

The public API is this package's names and the modules ``config``, ``errors``, ``models``,
``transforms``, ``integrations``, ``plots`` and ``ml`` (``ml.estimator``, ``ml.model``,
``ml.vocabulary``); a module with a part of its path starting with ``_`` (``sparkdl._internal``)
is internal and may change in any release (docs/reference/api.md).
"""
from __future__ import annotations

import importlib
from typing import Any

from sparkdl.config import TrainConfig
from sparkdl.errors import (
    AuthenticationError,
    ClusterConfigError,
    DataError,
    ParameterServerError,
    ProtocolError,
    PSTimeoutError,
    SparkDLError,
    WorkerError,
)

__version__ = "0.1.0"

_LAZY = {
    "train": "sparkdl._internal.modes.launcher",
    "TrainResult": "sparkdl._internal.modes.result",
    "spark_session": "sparkdl._internal.spark.session",
    "TorchEstimator": "sparkdl.ml.estimator",
    "TorchModel": "sparkdl.ml.model",
    "run": "sparkdl._internal.modes.functions.run",
    "TorchDistributor": "sparkdl._internal.modes.functions.run",
    "FunctionResult": "sparkdl._internal.modes.functions.run",
    "context": "sparkdl._internal.modes.functions.context",
    "load_latest_checkpoint": "sparkdl._internal.ps.server.checkpoint",
    "scoring_report": "sparkdl.ml._scoring_report",
    "ScoringReport": "sparkdl.ml._scoring_report",
}

__all__ = [
    "TrainConfig", "TrainResult", "train", "spark_session", "TorchEstimator", "TorchModel", "SparkDLError",
    "run", "TorchDistributor", "FunctionResult", "context", "load_latest_checkpoint",
    "ClusterConfigError", "scoring_report", "ScoringReport",
    "WorkerError", "DataError", "ParameterServerError", "PSTimeoutError", "AuthenticationError", "ProtocolError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparkdl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
