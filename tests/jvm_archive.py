"""A faster start for the suite's JVMs: a class-data archive of Spark's classes.

Every test that starts Spark (the shared session, each ``spark-submit``, each ``local-cluster``
executor, the Spark Connect server) spends most of its first seconds loading and verifying Spark's
classes.  The suite runs short jobs, so it gives every driver and executor JVM:

- ``-XX:SharedArchiveFile``: a dynamic class-data-sharing archive (JDK 13+) of the classes a
  small Spark job loads, made once per Java and pyspark installation and kept in the virtual
  environment (``sys.prefix``);
- not ``-XX:TieredStopAtLevel=1`` (the client compiler only): it shrinks the code cache to 48 MB,
  which the suite's long-lived driver filled ("CodeCache is full. Compiler has been disabled")
  before its JVM failed; with the cache set back to 240 MB, JVMs started sooner but the whole suite
  did not gain (docs/design/testing.md);
- ``-Xlog:cds*=off``: a JVM that cannot map the archive (another class path) runs without it
  and stays quiet.

They travel in ``SPARK_SUBMIT_OPTS``, which every ``spark-submit`` (pyspark's own gateway too)
adds to the driver's command line, with ``spark.executor.extraJavaOptions`` as a system property
of the driver, so that executors started by a ``local-cluster`` or standalone worker get them.
A class path directory must be empty for an archive, so ``SPARK_CONF_DIR`` is not used.

``SPARKDL_TEST_JVM_ARCHIVE=0`` turns this off; a ``SPARK_SUBMIT_OPTS`` already set is kept.

    python tests/jvm_archive.py          # make the archive now (about 25 s) and print the options
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: what the archive is made from: a session, files, a shuffle, Python workers, a barrier stage
WORKLOAD = """
import sys, pyarrow as pa
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").appName("sparkdl-test-jvm-archive")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2").getOrCreate())
path = sys.argv[1]
spark.range(1000).selectExpr("id", "id % 10 AS label", "array(cast(id AS float)) AS features") \\
    .write.mode("overwrite").parquet(path)
frame = spark.read.parquet(path)
frame.groupBy("label").count().collect()
frame.mapInArrow(lambda batches: (pa.RecordBatch.from_pydict({"n": [b.num_rows]}) for b in batches),
                 "n long").collect()
frame.rdd.barrier().mapPartitions(lambda rows: [sum(1 for _ in rows)]).collect()
small = spark.createDataFrame([(1, [1.0])], "id long, features array<float>")
if hasattr(small, "toArrow"):   # pyspark 4
    small.toArrow()
spark.stop()
"""


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    return str(Path(home) / "bin" / "java") if home else (shutil.which("java") or "java")


def archive_path() -> Path | None:
    """Where this Java and pyspark's archive lives (named by both), or None without a usable Java."""
    import pyspark

    try:
        version = subprocess.run([_java(), "-version"], capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256(f"{version}|{pyspark.__version__}|{pyspark.__file__}".encode()).hexdigest()[:16]
    return Path(sys.prefix) / "sparkdl-test-jvm" / f"spark-{key}.jsa"


def make_archive(path: Path) -> bool:
    """Run the workload once in a JVM that writes its loaded classes to ``path`` on exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        partial = Path(scratch) / "spark.jsa"
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_SUBMIT_OPTS": f"-XX:ArchiveClassesAtExit={partial} -Xlog:cds*=off"}
        done = subprocess.run([sys.executable, "-c", WORKLOAD, str(Path(scratch) / "data")], env=env,
                              capture_output=True, text=True, timeout=600)
        if done.returncode or not partial.exists():
            # said once per Java and pyspark: later runs go without an archive and do not try again
            path.with_suffix(".failed").write_text(done.stderr[-5000:])
            return False
        # written whole, then renamed: a concurrent run never maps half an archive
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        shutil.move(partial, staged)
        os.replace(staged, path)
    return True


def jvm_options() -> str | None:
    """The ``SPARK_SUBMIT_OPTS`` value that gives drivers and executors the archive, or None."""
    path = archive_path()
    if path is None or path.with_suffix(".failed").exists() or not (path.exists() or make_archive(path)):
        return None
    flags = f"-XX:SharedArchiveFile={path} -Xlog:cds*=off"
    return f'{flags} "-Dspark.executor.extraJavaOptions={flags}"'


def use_for_this_run() -> None:
    """Set ``SPARK_SUBMIT_OPTS`` for this process and every process it starts, unless told not to."""
    if os.environ.get("SPARKDL_TEST_JVM_ARCHIVE") == "0" or "SPARK_SUBMIT_OPTS" in os.environ:
        return
    options = jvm_options()
    if options is not None:
        os.environ["SPARK_SUBMIT_OPTS"] = options


if __name__ == "__main__":
    print(jvm_options() or "no archive: this Java cannot make one")
