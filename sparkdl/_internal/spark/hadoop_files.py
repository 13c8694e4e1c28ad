"""Files on any Hadoop-compatible file system, read and written by the driver through the JVM (no Spark job).

:class:`HadoopFiles` serves model persistence (whole files) and :class:`HadoopCheckpoints`
the parameter server's checkpoints on ``hdfs:``, ``s3a:``, ``abfss:``, ``dbfs:`` or ``file:``
URIs.  Object stores have no atomic rename, so a checkpoint is written first and a manifest
(``<name>.complete``, holding its length) after it; only checkpoints whose manifest is there
and whose length matches count.  :func:`checkpoint_files` picks the store for a location and
refuses, before launch, one the session cannot reach.
"""
from __future__ import annotations

import json
from typing import Any

from sparkdl._internal.ps.server.checkpoint import LOCAL, NAME, CheckpointFiles, state_bytes, state_from_bytes
from sparkdl._internal.spark.backend import ClassicBackend, SparkBackend
from sparkdl.errors import ClusterConfigError

#: bytes per py4j call when streaming a file to or from the JVM: bounds the size of one py4j message
CHUNK_BYTES = 4 << 20
#: the suffix of a checkpoint's manifest
MANIFEST = ".complete"


class HadoopFiles:
    """Whole-file reads and writes on the driver through the JVM's Hadoop FileSystem API (no Spark job)."""

    def __init__(self, spark_or_context: Any) -> None:
        jvm, jsc = getattr(spark_or_context, "_jvm", None), getattr(spark_or_context, "_jsc", None)
        if jvm is None or jsc is None:     # a Spark Connect session has no driver JVM to call
            raise RuntimeError("reading and writing Hadoop file system paths needs a classic SparkSession with a JVM "
                               "on the driver (Spark Connect is not supported); create the session with "
                               "sparkdl.spark_session() or SparkSession.builder without .remote()")
        self._jvm = jvm
        self._conf = jsc.hadoopConfiguration()

    def _resolve(self, path: str) -> tuple[Any, Any]:
        jpath = self._jvm.org.apache.hadoop.fs.Path(path)
        return jpath.getFileSystem(self._conf), jpath

    def exists(self, path: str) -> bool:
        """Whether ``path`` (file or directory) exists."""
        fs, jpath = self._resolve(path)
        return bool(fs.exists(jpath))

    def write(self, path: str, data: bytes) -> None:
        """Create (or replace) the file ``path`` holding ``data``, making parent directories as needed."""
        fs, jpath = self._resolve(path)
        stream = fs.create(jpath, True)
        try:
            view = memoryview(data)
            for start in range(0, len(data), CHUNK_BYTES):
                stream.write(bytes(view[start:start + CHUNK_BYTES]))    # py4j sends bytes as a Java byte[]
        finally:
            stream.close()

    def read(self, path: str) -> bytes:
        """The whole content of the file ``path``."""
        fs, jpath = self._resolve(path)
        stream = fs.open(jpath)
        parts: list[bytes] = []
        try:
            while True:
                # InputStream.readNBytes (Java 11+) returns a new byte[], which py4j hands over as
                # Python bytes; a buffer filled in place would not come back (py4j copies arrays)
                chunk = bytes(stream.readNBytes(CHUNK_BYTES))
                if not chunk:
                    break
                parts.append(chunk)
        finally:
            stream.close()
        return b"".join(parts)

    def names(self, directory: str) -> dict[str, int]:
        """The files directly in ``directory`` with their lengths (none when it does not exist)."""
        fs, jpath = self._resolve(directory)
        if not fs.exists(jpath):
            return {}
        return {status.getPath().getName(): int(status.getLen()) for status in fs.listStatus(jpath)
                if status.isFile()}

    def delete(self, path: str) -> None:
        fs, jpath = self._resolve(path)
        fs.delete(jpath, False)

    def make_directory(self, path: str) -> None:
        fs, jpath = self._resolve(path)
        fs.mkdirs(jpath)


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


class HadoopCheckpoints:
    """Checkpoints on a Hadoop file system: the file, then its manifest (object stores cannot rename atomically)."""

    def __init__(self, files: HadoopFiles) -> None:
        self.files = files

    def publish(self, directory: str, name: str, state: dict[str, Any]) -> str:
        data = state_bytes(state)
        path = _join(directory, name)
        self.files.write(path, data)
        # the manifest comes last: a crash before it leaves a file no reader trusts
        self.files.write(path + MANIFEST, json.dumps({"bytes": len(data)}).encode())
        return path

    def complete(self, directory: str) -> list[str]:
        present = self.files.names(directory)
        whole = []
        for name, length in present.items():
            if not NAME.match(name) or name + MANIFEST not in present:
                continue
            try:
                manifest = json.loads(self.files.read(_join(directory, name + MANIFEST)))
            except Exception:   # a manifest cut short: not JSON, or its checksum file is (file: URIs) ...
                continue
            if manifest.get("bytes") == length:
                whole.append(name)
        return sorted(whole)

    def read(self, directory: str, name: str) -> dict[str, Any]:
        return state_from_bytes(self.files.read(_join(directory, name)))

    def remove(self, directory: str, name: str) -> None:
        path = _join(directory, name)
        self.files.delete(path + MANIFEST)     # first: a half-removed checkpoint is never taken for whole
        self.files.delete(path)

    def location(self, directory: str, name: str) -> str:
        return _join(directory, name)


def has_scheme(location: str) -> bool:
    """Whether ``location`` is a URI (``hdfs://...``, ``file:/...``) rather than a plain path."""
    scheme, colon, _ = location.partition(":")
    return bool(colon) and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


def checkpoint_files(backend: SparkBackend, checkpoint_dir: str | None, resume_from: str | None) -> CheckpointFiles:
    """The store for a run's checkpoints (``checkpoint_dir`` and ``resume_from``), checked before launch.

    Plain paths are local files of the driver.  A URI goes through the Hadoop FileSystem API of
    the driver's JVM (``file:`` URIs too, so one code path serves every scheme); a URI whose file
    system the session cannot reach is refused here, naming the setting.  Spark Connect clients
    have no JVM: there ``file:`` URIs are written by the client itself and other schemes are refused.
    """
    named = {"checkpoint_dir": checkpoint_dir, "resume_from": resume_from}
    uris = {setting: where for setting, where in named.items() if where and has_scheme(where)}
    if not uris:
        return LOCAL
    if not isinstance(backend, ClassicBackend):
        if all(uri.startswith("file:") for uri in uris.values()):
            return LOCAL
        setting, uri = next((s, u) for s, u in uris.items() if not u.startswith("file:"))
        raise ClusterConfigError(
            f"{setting}={uri!r} needs the Hadoop FileSystem of a classic session's driver, and a Spark Connect client "
            "has none: use a path this client can write (a mounted volume, or a file: URI), or run the job from a "
            "classic session")
    files = HadoopFiles(backend.sc)
    for setting, uri in uris.items():
        try:
            if setting == "checkpoint_dir":
                files.make_directory(uri)   # also proves the run can write there before it starts
            else:
                files.exists(uri)
        except Exception as exc:   # py4j: "No FileSystem for scheme", credentials, a host that is down
            lines = str(exc).strip().splitlines()
            cause = next((line for line in lines if "Exception" in line), lines[0] if lines else type(exc).__name__)
            raise ClusterConfigError(
                f"{setting}={uri!r} cannot be reached through the driver's Hadoop FileSystem ({cause.strip()}); check "
                "the URI, the file system's jars and credentials (spark.hadoop.* settings), or use a local path") from None
    return HadoopCheckpoints(files)

