"""How much driver memory a parameter server needs, checked before launch."""
from __future__ import annotations

from collections.abc import Sequence

from sparkdl._internal.memory import available_memory_bytes
from sparkdl._internal.ps.tables import TableSpec, table_bytes
from sparkdl._internal.training.optim import server_momentum
from sparkdl.config import TrainConfig
from sparkdl.errors import ClusterConfigError

#: share of the machine's available memory a run may plan for when no limit is configured
DEFAULT_SHARE = 0.8


def ps_memory_bytes(config: TrainConfig, num_params: int, float_buffer_count: int = 0) -> int:
    """Bytes the PS holds at its peak for a model of ``num_params`` float32 values.

    Master weights and the gradient sum; the optimizer state (momentum: one copy, Adam: two);
    per worker connection a receive and a reply buffer (plus an encoded buffer with a lossy
    codec, and for a pipelined worker the buffer its stages' ranges are assembled in) and its
    float buffers; a checkpoint snapshot (weights and optimizer state).  With the shards on
    the executors the driver holds only snapshots: the newest consistent cut, the one being
    collected, and a merged checkpoint.
    """
    optimizer_copies = 2 if config.optimizer in ("adam", "adamw") else (1 if server_momentum(config) else 0)
    snapshot = 1 + optimizer_copies
    if config.mode.executor_shards:
        return 4 * num_params * snapshot * (3 if config.checkpoint_dir else 2)
    per_connection = 2 + (1 if config.compression != "none" else 0) + (1 if config.mode.pipelined else 0)
    workers = max(config.num_workers, config.max_workers or 0)   # the most that train at once
    copies = 2 + optimizer_copies + per_connection * workers
    if config.checkpoint_dir:
        copies += snapshot
    # the float buffers each worker reports at its end (work units: each unit's newest)
    return 4 * (num_params * copies + float_buffer_count * (config.work_units or config.num_workers))


def tables_memory_bytes(config: TrainConfig, tables: Sequence[TableSpec]) -> int:
    """Bytes the driver holds at its peak for embedding ``tables``: with its own PS, each table's rows and
    row-wise optimizer state, a checkpoint snapshot of both, a copy of the rows for the best epoch
    (validation with ``restore_best_weights``) and for the result; with the shards on the executors, the
    same: the newest cut's rows (laid over the initial ones) and optimizer state, a merged checkpoint, the
    shards' best rows and the result (snapshots carry changed rows only, a small part).  With ``shared_tables``
    the rows and their state move into shared memory while the driver's model keeps its rows: the rows once more."""
    total = 0
    for table in tables:
        rows_bytes = table_bytes(table.rows, table.dim, "sgd")
        with_state = table_bytes(table.rows, table.dim, table.optimizer)
        total += with_state + rows_bytes + (rows_bytes if config.shared_tables else 0)
        if config.checkpoint_dir:
            total += with_state
        if config.validation_fraction and config.restore_best_weights:
            total += rows_bytes
    return total


def check_ps_memory(config: TrainConfig, num_params: int, float_buffer_count: int = 0,
                    tables: Sequence[TableSpec] = ()) -> None:
    """Refuse a run whose PS (with its embedding ``tables``) would not fit the configured (or available)
    driver memory."""
    table_part = tables_memory_bytes(config, tables)
    needed = ps_memory_bytes(config, num_params, float_buffer_count) + table_part
    if config.ps_memory_limit_mb is not None:
        limit, source = config.ps_memory_limit_mb * 2**20, f"ps_memory_limit_mb={config.ps_memory_limit_mb:g}"
    else:
        available = available_memory_bytes()
        if available is None:
            return
        limit = DEFAULT_SHARE * available
        source = f"{DEFAULT_SHARE:.0%} of the driver machine's available memory ({available / 2**20:,.0f} MB)"
    if needed > limit:
        raise ClusterConfigError(
            f"the parameter server would need about {needed / 2**20:,.0f} MB of driver memory for "
            f"{num_params:,} parameters with {config.num_workers} workers ({config.optimizer}"
            f"{', momentum' if config.optimizer == 'sgd' and config.momentum else ''})"
            + (f" and {table_part / 2**20:,.0f} MB for the embedding tables {[t.name for t in tables]} "
               "(rows and row-wise optimizer state)" if tables else "")
            + f", more than {source}; use fewer workers, a smaller model, plain SGD"
            + (", fewer or narrower table rows, embedding_optimizer='sgd'" if tables else "")
            + ", or a driver with more memory (or raise ps_memory_limit_mb)")
