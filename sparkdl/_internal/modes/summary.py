"""The headline figures of a finished run, the same for every mode (the run summary)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from sparkdl._internal.mode import Mode
from sparkdl._internal.ps.server.runlog import ValidationRow
from sparkdl._internal.training.losses import validation_metric
from sparkdl._internal.training.optim import server_momentum
from sparkdl.config import TrainConfig


def validation_summary(config: TrainConfig, rows: Sequence[ValidationRow], best: ValidationRow | None,
                       stopped_early: bool) -> dict[str, Any]:
    """The validation figures of a run: last and best scores, early stopping, whose weights were kept."""
    if not config.validation_fraction:
        return {}
    return {"validation_metric": validation_metric(config.loss),
            "val_loss": rows[-1].val_loss if rows else float("nan"),
            "val_metric": rows[-1].val_metric if rows else float("nan"),
            "best_epoch": best.epoch if best else None, "best_val_loss": best.val_loss if best else float("nan"),
            "best_val_metric": best.val_metric if best else float("nan"), "stopped_early": stopped_early,
            "restored_best_weights": bool(config.restore_best_weights and best is not None),
            "validation": [dataclasses.asdict(row) for row in rows]}


def run_summary(config: TrainConfig, workers: list[dict[str, Any]], history: Any, gradients: Any,
                 attempts: list[dict[str, Any]], started: float, stage_seconds: float,
                 **counts: Any) -> dict[str, Any]:
    """The headline figures of a run: those every mode has, plus its own ``counts``.

    ``loop_seconds`` is the slowest worker's training loop (compute plus exchanges, which
    include the optimizer step in every mode), so samples/s mean the same for every policy.
    """
    samples = sum(w["samples"] for w in workers)
    # allreduce workers skip the same float16 steps (they unscale the same averaged gradient): count them once
    identical = config.mode is Mode.ALLREDUCE and config.local_update == "accumulate"
    skipped = [w.get("amp_skipped_steps", 0) for w in workers]
    # work units: each task is one unit's pass, and the tasks come and go: the stage's wall time
    loop_seconds = (stage_seconds if config.work_units else
                    max((w["compute_seconds"] + w["communication_seconds"] for w in workers), default=0.0))
    return {
        # the training mode (sparkdl._internal.mode.Mode): parameter_server, executor_shards, pipeline, ...
        "mode": config.mode.value, "policy": config.policy, "num_workers": config.num_workers,
        "work_units": config.work_units, "epochs": config.epochs,
        "batch_size": config.batch_size, **counts,
        # the momentum the PS applied: 'momentum', or less under implicit_momentum='compensate'
        "server_momentum": server_momentum(config),
        "samples": samples, "train_seconds": time.perf_counter() - started, "stage_seconds": stage_seconds,
        "loop_seconds": loop_seconds, "samples_per_second": samples / loop_seconds if loop_seconds else 0.0,
        "staleness_mean": float(gradients["staleness"].mean()) if len(gradients) else 0.0,
        "staleness_max": int(gradients["staleness"].max()) if len(gradients) else 0,
        "bytes_pushed": sum(w["bytes_pushed"] for w in workers),
        "bytes_pulled": sum(w["bytes_pulled"] for w in workers),
        "attempts": len(attempts),
        # where the partitions were kept ("disk", "memory", or both under data_cache="auto") and the most
        # memory one task's Python worker used
        # (pipeline stages after the first read no data)
        "data_cache": ",".join(sorted({w["data_cache"] for w in workers if "data_cache" in w})),
        "peak_worker_rss_bytes": max((w.get("peak_rss_bytes", 0) for w in workers), default=0),
        # how far one task's Python worker grew from its size at the task's start (reused workers start larger)
        "peak_worker_rss_growth_bytes": max((w["peak_rss_bytes"] - w["start_rss_bytes"] for w in workers
                                             if "start_rss_bytes" in w), default=0),
        "final_loss": float(history["loss"].iloc[-1]) if len(history) else float("nan"),
        # precision="16-mixed": steps the loss scaler skipped because their gradient overflowed
        "amp_skipped_steps": max(skipped, default=0) if identical else sum(skipped),
    }
