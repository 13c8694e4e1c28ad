"""What every mode's driver is handed, and the driver-side helpers several modes share.

The launcher (``modes.launcher``) checks the settings and the cluster, builds the model's
template once and hands a :class:`Launch` to the driver its mode names
(``modes.launcher.DRIVERS``): each driver starts what its mode needs (a parameter server, a
shard coordinator, nothing), runs the barrier stage and reads the result.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from sparkdl._internal.data.cache import ChunksFn
from sparkdl._internal.mode import Mode
from sparkdl._internal.ps.server.checkpoint import CheckpointFiles, load_latest_checkpoint
from sparkdl._internal.ps.server.runlog import EpochRow
from sparkdl._internal.ps.server.server import ParameterServer
from sparkdl._internal.ps.tables import TableSpec, row_optimizer, with_state_of
from sparkdl._internal.spark.backend import SparkBackend
from sparkdl._internal.spark.barrier import BarrierStageFn
from sparkdl._internal.training.pipeline_cuts import StageLayout
from sparkdl.config import TrainConfig
from sparkdl.errors import SparkDLError
from sparkdl.transforms import resolve_transform


@dataclass(frozen=True)
class Launch:
    """One run as the launcher hands it to its mode's driver."""

    backend: SparkBackend
    model_fn: Callable[[], nn.Module]
    config: TrainConfig
    run_barrier_stage: BarrierStageFn
    read_chunks: ChunksFn
    #: the model built once on the driver (its embedding tables' rows included)
    template: nn.Module
    #: when the run started (``time.perf_counter``), for its summary's train_seconds
    started: float
    #: pipelines: the model's cut into stages (None: every task holds the whole model)
    layout: StageLayout | None = None
    #: forward's keyword arguments, one per input column
    input_args: tuple[str, ...] = ()
    #: the model's embedding tables, held by the parameter server as rows
    tables: tuple[TableSpec, ...] = ()

    @property
    def mode(self) -> Mode:
        return self.config.mode


def shipped(config: TrainConfig) -> TrainConfig:
    """The settings the tasks receive: the callbacks stay on the driver, where they are called."""
    return config.replace(callbacks=()) if config.callbacks else config


def epoch_listener(config: TrainConfig, server: Callable[[], ParameterServer]) -> Callable[[EpochRow], bool]:
    """Calls every callback's ``on_epoch_end(epoch, metrics)`` for a completed epoch; True: stop training.

    ``metrics`` holds the epoch's mean training loss, the trainStep's metrics and, when the epoch
    was validated, ``val_loss`` and ``val_metric``.  A callback that raises fails the run with its
    traceback (the model and checkpoints are kept as they are).
    """
    callbacks = [_callback(c) for c in config.callbacks]

    def on_epoch(row: EpochRow) -> bool:
        ps = server()
        validated = ps.read(lambda core: next((v for v in core.log.validation if v.epoch == row.epoch), None))
        metrics = {**row.metrics, **({"val_loss": validated.val_loss, "val_metric": validated.val_metric}
                                     if validated is not None else {})}
        stop = False
        for callback in callbacks:
            try:
                stop = bool(callback.on_epoch_end(row.epoch, dict(metrics))) or stop
            except Exception:
                ps.fail(SparkDLError(f"callback {type(callback).__name__}.on_epoch_end failed after epoch "
                                     f"{row.epoch}:\n{traceback.format_exc()}"))
                return False
        return stop
    return on_epoch


def _callback(value: Any) -> Any:
    """A callback object: as given, or the object (or a new instance of the class) a 'module:qualname' names."""
    if not isinstance(value, str):
        return value
    target = resolve_transform(value, "callbacks")
    return target() if isinstance(target, type) else target


def resume_checkpoint(config: TrainConfig, files: CheckpointFiles) -> dict:
    """The checkpoint ``resume_from`` names, with its tables' state of this run's row optimizer only."""
    assert config.resume_from is not None   # called only when resume_from is set
    checkpoint = load_latest_checkpoint(config.resume_from, files)
    if checkpoint is None:
        raise SparkDLError(f"resume_from={config.resume_from!r} holds no complete checkpoint (ckpt-*.pt)")
    # the tables' state of this run's row optimizer only (what a shard's messages have room for)
    checkpoint["tables"] = [with_state_of(table, row_optimizer(config)) for table in checkpoint.get("tables", [])]
    return checkpoint


def tls_pems(config: TrainConfig) -> tuple[str | None, str | None]:
    """The run's certificate and key as PEM text (None, None: the run is not TLS)."""
    if not config.tls_cert:
        return None, None
    assert config.tls_key is not None   # TrainConfig requires tls_cert and tls_key together
    return Path(config.tls_cert).read_text(), Path(config.tls_key).read_text()
