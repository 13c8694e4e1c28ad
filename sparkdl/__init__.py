"""sparkdl: data-parallel PyTorch training inside Apache Spark, with a parameter server."""
from .config import TrainConfig
from .errors import (AuthenticationError, ClusterConfigError, ParameterServerError, ProtocolError,
                     PSTimeoutError, SparkDLError, WorkerError)
from .runtime.launcher import train
from .runtime.result import TrainResult
from .runtime.session import spark_session

__version__ = "0.1.0"

__all__ = [
    "TrainConfig", "TrainResult", "train", "spark_session", "SparkDLError", "ClusterConfigError",
    "WorkerError", "ParameterServerError", "PSTimeoutError", "AuthenticationError", "ProtocolError",
    "__version__",
]
