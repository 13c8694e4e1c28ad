"""Spark glue: the driver-side launcher and the executor-side worker."""
