"""Readings of memory: this process's peak, the machine's available memory (Linux ``/proc``, with portable fallbacks)."""
from __future__ import annotations

import ctypes
import functools
import os
import resource
import sys
from collections.abc import Callable


def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(None), "malloc_trim", None)    # the process's own symbols: libc's


def release_freed_memory() -> None:
    """Hand the pages freed by earlier tasks back to the system: Arrow's pool, then the C heap (``malloc_trim``).

    A reused Python worker otherwise keeps what an earlier task freed: its resident size then depends
    on the worker's history, and a new task reuses those pages without its own growth showing.  (No
    ``gc.collect()``: with torch loaded it takes 0.1-0.15 s, and a task's data and replica are freed by
    reference counting when it ends.)
    """
    if "pyarrow" in sys.modules:      # Arrow's own allocator keeps freed batches' pages
        sys.modules["pyarrow"].default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


#: glibc's mallopt parameter for the size from which a block gets its own mapping (returned when freed)
_M_MMAP_THRESHOLD = -3
#: blocks from 1 MiB up: each of a large model's blocks, gathered and freed every step
RETURNED_BLOCK_BYTES = 1 << 20


def return_large_blocks_when_freed() -> bool:
    """Give every C heap block of :data:`RETURNED_BLOCK_BYTES` or more its own mapping, handed back when freed.

    glibc raises its mmap threshold to the size of the largest mapped block freed so far (up to 32 MiB),
    and from then on keeps blocks below it in its heaps, where freed ones stay resident.  A fully sharded
    worker allocates and frees each block's full parameters and gradient every step, so it grew to about
    3x its need (a 31M-parameter MLP's worker: 1.2 GB peak against 0.65 GB with a fixed threshold).  A
    fixed threshold turns that raising off, for the rest of this Python worker's life.  False where glibc
    is not the allocator.
    """
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, RETURNED_BLOCK_BYTES))


def rss_bytes() -> int:
    """This process's resident set now (0 where ``/proc`` is missing)."""
    return (_proc_status_kb("VmRSS") or 0) * 1024


def reset_peak_rss() -> bool:
    """Release freed memory, then restart this process's peak resident-set reading from its current size (Linux only).

    Python workers are reused across tasks, so without this a task's peak would include
    whatever an earlier task of the same worker held.  False when the kernel does not allow it.
    """
    release_freed_memory()
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")       # 5: reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident set since start or the last :func:`reset_peak_rss`."""
    peak_kb = _proc_status_kb("VmHWM")
    if peak_kb is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024      # bytes on macOS, KiB elsewhere
    return peak_kb * 1024


#: bytes per trained parameter while a task builds its replica: the module's own tensors, then the
#: flat weights and gradient they move into (the module's are freed after)
REPLICA_BUILD_BYTES_PER_PARAMETER = 12


def require_address_space(needed: int, what: str, advice: str) -> None:
    """Fail clearly, before allocating, when ``needed`` more bytes would exceed this process's limit.

    Spark enforces ``spark.executor.pyspark.memory`` as an address-space limit (``RLIMIT_AS``)
    on each Python worker; past it an allocation raises a bare ``MemoryError`` or kills the
    worker.  Without a limit (or off Linux) this checks nothing.
    """
    from sparkdl.errors import ClusterConfigError

    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    used_kb = _proc_status_kb("VmSize")
    if limit == resource.RLIM_INFINITY or used_kb is None:
        return
    left = limit - used_kb * 1024
    if needed > left:
        raise ClusterConfigError(
            f"{what} needs {needed / 2**20:.0f} MiB, but this task's Python worker has only {max(left, 0) / 2**20:.0f} "
            f"MiB left of its {limit / 2**20:.0f} MiB limit (spark.executor.pyspark.memory over the executor's "
            f"task slots). {advice}")


def available_memory_bytes() -> int | None:
    """Memory this machine can still give a process (Linux ``MemAvailable``), if it can be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
