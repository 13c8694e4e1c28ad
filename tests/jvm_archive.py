"""A faster start for the suite's JVMs: a class-data archive of Spark's classes, and one compiler.

Every test that starts Spark (the shared session, each ``spark-submit``, each ``local-cluster``
executor, the Spark Connect server) spends most of its first seconds loading and verifying Spark's
classes.  The suite runs short jobs, so it gives every driver and executor JVM:

- ``-XX:SharedArchiveFile``: a dynamic class-data-sharing archive (JDK 13+) of the classes a
  small Spark job loads, made once per Java and pyspark installation and kept in the virtual
  environment (``sys.prefix``);
- ``-XX:TieredStopAtLevel=1`` (the client compiler only: a JVM that lives for one test spends its
  first seconds compiling with both compilers on 2 cores) with ``-XX:ReservedCodeCacheSize=240m``
  (alone, the client compiler shrinks the code cache to 48 MB, which a long-lived driver filled:
  "CodeCache is full. Compiler has been disabled"). Not for the session every integration test
  shares (``long_lived_driver``): its jobs ran slower with the client compiler's code;
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

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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


#: for a JVM that lives for one test: the client compiler only, with the default code cache size
ONE_COMPILER = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"

#: the options of a driver that lives for the whole run in this process (both compilers), once set
_long_lived: str | None = None


def archive_flags() -> str | None:
    """The JVM flags that map the archive (made now if missing), or None without one."""
    path = archive_path()
    if path is None or path.with_suffix(".failed").exists() or not (path.exists() or make_archive(path)):
        return None
    return f"-XX:SharedArchiveFile={path} -Xlog:cds*=off"


def submit_options(flags: str) -> str:
    """The ``SPARK_SUBMIT_OPTS`` value that gives a driver and its executors ``flags``."""
    return f'{flags} "-Dspark.executor.extraJavaOptions={flags}"'


def use_for_this_run() -> None:
    """Set ``SPARK_SUBMIT_OPTS`` for this process and every process it starts (the archive and the client
    compiler), unless told not to."""
    global _long_lived
    if os.environ.get("SPARKDL_TEST_JVM_ARCHIVE") == "0" or "SPARK_SUBMIT_OPTS" in os.environ:
        return
    flags = archive_flags()
    if flags is not None:
        os.environ["SPARK_SUBMIT_OPTS"] = submit_options(f"{flags} {ONE_COMPILER}")
        _long_lived = submit_options(flags)


@contextlib.contextmanager
def long_lived_driver() -> Iterator[None]:
    """A driver started in this block gets the archive and both compilers: it runs jobs for the whole run."""
    saved = os.environ.get("SPARK_SUBMIT_OPTS")
    if _long_lived is not None:
        os.environ["SPARK_SUBMIT_OPTS"] = _long_lived
    try:
        yield
    finally:
        if saved is not None:
            os.environ["SPARK_SUBMIT_OPTS"] = saved


if __name__ == "__main__":
    flags = archive_flags()
    print(submit_options(f"{flags} {ONE_COMPILER}") if flags else "no archive: this Java cannot make one")
