"""sparkdl: data-parallel PyTorch training inside Apache Spark, with a parameter server.

The Spark-facing names are imported on first use, so ``sparkdl.ps`` (the parameter server)
and ``sparkdl.config`` load without pyspark.
"""
from __future__ import annotations

import importlib
from typing import Any

from .config import TrainConfig
from .errors import (
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
    "train": "sparkdl.modes.launcher",
    "TrainResult": "sparkdl.modes.result",
    "spark_session": "sparkdl.spark.session",
    "TorchEstimator": "sparkdl.ml.estimator",
    "TorchModel": "sparkdl.ml.model",
    "run": "sparkdl.modes.functions",
    "TorchDistributor": "sparkdl.modes.functions",
    "FunctionResult": "sparkdl.modes.functions",
    "context": "sparkdl.modes.context",
}

__all__ = [
    "TrainConfig", "TrainResult", "train", "spark_session", "TorchEstimator", "TorchModel", "SparkDLError",
    "run", "TorchDistributor", "FunctionResult", "context",
    "ClusterConfigError",
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
