"""Embedding tables in shared memory: the PS's rows, their row-optimizer state and step counts in one mapped
file per table, which the workers on its host read and update in place (``shared_tables``, Hogwild-style:
Recht, Re, Wright and Niu, "Hogwild!: A Lock-Free Approach to Parallelizing Stochastic Gradient Descent",
NIPS 2011).

A worker gathers a batch's rows straight from the file and, after its backward, steps the rows it touched
with the table's row optimizer (:func:`sparkdl._internal.ps.row_steps.step_rows`) without any lock, while
the other workers and the PS (for workers on other hosts, whose rows still arrive as messages) do the same.
What a reader can see is the Hogwild model: a row may be read while another process writes it (part old,
part new), and two processes stepping one row at once may lose one of the two updates.  The step count of
lazy Adam's bias correction is a counter per process (slot 0 the PS's, slot ``w + 1`` worker ``w``'s), each
written by its owner only, summed when read, so no step is lost from it.

The file has the same protections as the shared master (:class:`~sparkdl._internal.ps.wire.shared_memory.SharedMaster`):
owner-only, ``O_EXCL``, space reserved up front, a random name until the PS's port is known, then an HMAC of
the job's secret, the port and the table's index; it is removed when the PS stops.
"""
from __future__ import annotations

import mmap
import os

import torch

from sparkdl._internal.ps.tables import STATE_KEYS, TableSpec
from sparkdl._internal.ps.wire.shared_memory import (
    SHM_DIR,
    SharedFile,
    attach_mapped,
    create_mapped,
    file_name,
    unnamed_path,
)


def table_file_name(secret: bytes, port: int, table: int) -> str:
    """A shared table's file name: unguessable without the job's secret, distinct per PS (port) and table."""
    return file_name(secret, f"sparkdl-table:{port}:{table}")


class SharedTable(SharedFile):
    """One table's rows, its row optimizer's state (:data:`~sparkdl._internal.ps.tables.STATE_KEYS` order) and
    ``slots`` step counters, as tensors over one mapped file."""

    def __init__(self, path: str, buffer: mmap.mmap, spec: TableSpec, slots: int) -> None:
        self.path = path
        self._buffer = buffer
        self.spec = spec
        values = spec.rows * spec.dim
        blocks = [torch.frombuffer(buffer, dtype=torch.float32, count=values, offset=4 * values * block)
                  .view(spec.rows, spec.dim) for block in range(1 + len(STATE_KEYS[spec.optimizer]))]
        self.weight = blocks[0]
        self.state = tuple(blocks[1:])
        #: per writer (0: the PS, w + 1: worker w), the updates it applied; their sum is the table's step count
        self.steps = torch.frombuffer(buffer, dtype=torch.int64, count=slots, offset=self._counters_at(spec))

    @staticmethod
    def _counters_at(spec: TableSpec) -> int:
        """Where the step counters start: after the float blocks, rounded up to 8 bytes (aligned int64s)."""
        return -(-4 * spec.rows * spec.dim * (1 + len(STATE_KEYS[spec.optimizer])) // 8) * 8

    @classmethod
    def size(cls, spec: TableSpec, slots: int) -> int:
        """The file's bytes."""
        return cls._counters_at(spec) + 8 * slots

    @classmethod
    def create(cls, spec: TableSpec, slots: int) -> SharedTable | None:
        """The PS side: a zeroed table under a random name; None when this host cannot give one."""
        path = unnamed_path()
        buffer = create_mapped(path, cls.size(spec, slots))
        return None if buffer is None else cls(path, buffer, spec, slots)

    @classmethod
    def attach(cls, name: str, spec: TableSpec, slots: int) -> SharedTable | None:
        """The worker side: map the PS's table; None when it is not here (its rows then travel as messages)."""
        path = os.path.join(SHM_DIR, name)
        buffer = attach_mapped(path, cls.size(spec, slots))
        return None if buffer is None else cls(path, buffer, spec, slots)
