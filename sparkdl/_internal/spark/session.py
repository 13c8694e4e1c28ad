"""Creating a SparkSession whose executors run this interpreter (the one that has sparkdl)."""
from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession


def read_properties(path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse a spark-submit ``--properties-file`` (``key value`` or ``key=value`` lines)."""
    properties: dict[str, str] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        match = re.match(r"([^\s=:]+)\s*[=:\s]\s*(.*)$", line)
        if match is None:
            raise ValueError(f"{path}: cannot parse the line {raw!r}; expected 'key value'")
        properties[match.group(1)] = match.group(2).strip()
    return properties


#: the Python worker daemon of sparkdl's sessions: workers forked with torch already imported (sparkdl.daemon)
DAEMON_SETTING, DAEMON = "spark.python.daemon.module", "sparkdl.daemon"


def spark_session(app_name: str = "sparkdl", master: str | None = None,
                  conf: Mapping[str, str] | None = None, remote: str | None = None) -> SparkSession:
    """Get or create a SparkSession set up for sparkdl.

    Executors on this machine (local and local-cluster modes) run ``sys.executable``
    unless ``PYSPARK_PYTHON`` or ``spark.pyspark.python`` already says otherwise; without it
    they would start the system Python, which lacks sparkdl and torch.

    ``remote`` makes a Spark Connect session instead: ``"local[N]"`` starts a Connect server
    in this process (its Python workers run ``sys.executable`` too, and ``conf`` configures
    that server), ``"sc://host:port"`` connects to a running one, whose executors need sparkdl
    and torch installed there (see docs/guides/spark-connect.md).

    The Python workers are forked from :mod:`sparkdl.daemon` (torch imported once per executor, not per
    worker) unless ``conf`` sets ``spark.python.daemon.module``.
    """
    if remote is not None and master is not None:
        raise ValueError("give master (a classic session) or remote (Spark Connect), not both; for a local "
                         "Spark Connect server pass remote='local[N]'")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    python = os.environ["PYSPARK_PYTHON"]
    if os.sep in python and not os.path.isabs(python) and os.path.exists(python):
        # executors run in their own working directories, where a relative path breaks
        os.environ["PYSPARK_PYTHON"] = os.path.abspath(python)
    settings = dict(conf or {})
    if remote is not None:
        return _connect_session(app_name, remote, settings)
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        settings["spark.master"] = master
    elif "spark.master" not in settings and "MASTER" not in os.environ and not under_spark_submit():
        settings["spark.master"] = "local[2]"
    settings.setdefault("spark.ui.showConsoleProgress", "false")
    settings.setdefault(DAEMON_SETTING, DAEMON)
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _connect_session(app_name: str, remote: str, settings: dict[str, str]) -> SparkSession:
    """A Spark Connect session; ``remote="local..."`` starts the server in this process first."""
    local = remote.startswith("local")
    if local:
        # the in-process server is a SparkContext: its static settings apply when it starts
        settings.setdefault("spark.ui.showConsoleProgress", "false")
        settings.setdefault(DAEMON_SETTING, DAEMON)
    builder = SparkSession.builder.remote(remote).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    with warnings.catch_warnings():
        if local:
            # pyspark applies every setting to the new server, then tries the static ones again on the
            # session and warns that they cannot change there; they did apply
            warnings.filterwarnings("ignore", message=r"Failed to set spark\.", category=UserWarning)
        return builder.getOrCreate()


def under_spark_submit() -> bool:
    """True when spark-submit started this driver (it passes its settings to the JVM itself)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ
