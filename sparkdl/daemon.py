"""The Python worker daemon for Spark sessions that run sparkdl: ``spark.python.daemon.module=sparkdl.daemon``.

Spark starts ``python -m <spark.python.daemon.module>`` once per executor and forks every Python worker from
it.  With pyspark's own daemon (``pyspark.daemon``) each new worker imports torch itself, about 3 s of CPU on a
small machine, paid again by every task that starts a worker; this daemon imports torch and sparkdl's executor
side once, before it forks, so a new worker starts with them.  :func:`sparkdl.spark_session` sets it; on a
cluster started otherwise, set it in the Spark configuration (sparkdl must be installed on the executors, as
for any sparkdl job).

Importing torch starts none of its thread pools (they start at a worker's first parallel operation), so the
forked workers set their own thread counts as before.  A session whose Python workers never run torch pays
the import once per executor for nothing: leave the setting at ``pyspark.daemon`` there.
"""
from __future__ import annotations

import pyspark.daemon
import torch  # noqa: F401   # imported before the workers are forked: the point of this daemon

import sparkdl.ml._scoring  # noqa: F401   # the executor side of scoring (pyarrow, numpy, sparkdl's data path)

__all__ = ["main"]


def main() -> None:
    """Serve Spark's requests for Python workers, as ``pyspark.daemon`` does."""
    pyspark.daemon.manager()


if __name__ == "__main__":
    main()
