"""pyspark.ml front end: ``TorchEstimator`` (``sparkdl.ml.estimator``), ``TorchModel`` (``sparkdl.ml.model``)
and the token vocabulary (``sparkdl.ml.vocabulary``); the only place importing pyspark.ml.

The modules whose names start with ``_`` are internal (docs/reference/api.md).
"""
from __future__ import annotations

__all__ = ["estimator", "model", "vocabulary"]
