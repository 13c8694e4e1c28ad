"""Validated, immutable training configuration shared by the driver and the executors."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

POLICIES = ("sync", "async", "softsync", "allreduce")
OPTIMIZERS = ("sgd", "adam")
LOSSES = ("cross_entropy", "mse", "bce_with_logits")
STALENESS_LR = ("none", "inverse")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides the data and the model factory.

    ``batch_size`` is per worker: one optimizer update in ``sync`` mode sees
    ``num_workers * batch_size * local_steps`` samples.
    """

    num_workers: int = 2
    epochs: int = 5
    batch_size: int = 32
    policy: str = "sync"
    #: softsync: number of gradients (from any workers) averaged into one update; 1 <= c <= N.
    softsync_size: int = 1
    #: mini-batch gradients a worker averages locally before one push (delayed update).
    local_steps: int = 1
    #: "inverse" scales the learning rate of a gradient with staleness tau >= 1 by 1/tau.
    staleness_lr: str = "none"
    #: gradients staler than this many versions are dropped (None: no bound).
    max_staleness: int | None = None
    optimizer: str = "sgd"
    learning_rate: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    #: "cross_entropy" | "mse" | "bce_with_logits" or a callable ``loss(output, target)``.
    loss: str | Callable[..., Any] = "cross_entropy"
    seed: int = 0
    #: reshuffle every worker's shard at each epoch (deterministic given ``seed``).
    shuffle: bool = True
    #: bound, in seconds, on every blocking wait (PS rounds, worker replies, rendezvous).
    timeout_s: float = 300.0
    #: port of the parameter server on the driver (0: any free port).
    ps_port: int = 0
    #: "auto" (Spark-assigned GPU if any, else CPU), "cpu" or "cuda".
    device: str = "auto"
    #: gradient compression on the push: "none", "fp16", "int8" or "topk" (error feedback for lossy ones).
    compression: str = "none"
    #: topk: fraction of the gradient's entries sent per push.
    topk_ratio: float = 0.01
    #: directory for parameter-server checkpoints (None: none are written).
    checkpoint_dir: str | None = None
    #: updates between two checkpoints (one is always written at the end).
    checkpoint_every: int = 100
    #: newest checkpoints kept; older ones are deleted.
    checkpoint_keep: int = 3
    #: continue from the newest complete checkpoint in this directory (driver restart).
    resume_from: str | None = None
    #: barrier-stage attempts before the run fails (a retry continues from the PS's state).
    max_attempts: int = 3
    #: a gradient with NaN/Inf: "skip" (refuse and count it) or "fail" (stop the run).
    nonfinite: str = "skip"
    #: PEM certificate and key for TLS between workers and the PS (None: plain TCP).
    tls_cert: str | None = None
    tls_key: str | None = None
    #: show a live progress bar on the driver (tqdm)
    verbose: bool = False

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {value!r}")

        for name in ("num_workers", "epochs", "batch_size", "softsync_size", "local_steps", "checkpoint_every",
                     "checkpoint_keep", "max_attempts"):
            positive(name)
        choices = {"policy": POLICIES, "optimizer": OPTIMIZERS, "staleness_lr": STALENESS_LR,
                   "device": ("auto", "cpu", "cuda"), "nonfinite": ("skip", "fail"),
                   "compression": ("none", "fp16", "int8", "topk")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if isinstance(self.loss, str) and self.loss not in LOSSES:
            raise ValueError(f"TrainConfig.loss must be one of {LOSSES} or a callable, got {self.loss!r}")
        if not isinstance(self.loss, str) and not callable(self.loss):
            raise ValueError(f"TrainConfig.loss must be a string or a callable, got {self.loss!r}")
        if self.policy == "softsync" and self.softsync_size > self.num_workers:
            raise ValueError(
                f"TrainConfig.softsync_size ({self.softsync_size}) must be between 1 and "
                f"num_workers ({self.num_workers})")
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int) or self.max_staleness < 0):
            raise ValueError(f"TrainConfig.max_staleness must be None or an integer >= 0, got {self.max_staleness!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"TrainConfig.learning_rate must be > 0, got {self.learning_rate!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"TrainConfig.momentum must be in [0, 1), got {self.momentum!r}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"TrainConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        if not 0 < self.topk_ratio <= 1:
            raise ValueError(f"TrainConfig.topk_ratio must be in (0, 1], got {self.topk_ratio!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TrainConfig.tls_cert and tls_key must be given together")
        if not 0 <= self.ps_port < 65536:
            raise ValueError(f"TrainConfig.ps_port must be in [0, 65535], got {self.ps_port!r}")

    @property
    def gradients_per_update(self) -> int:
        """How many pushed gradients the PS averages into one optimizer step."""
        return {"sync": self.num_workers, "allreduce": self.num_workers, "async": 1,
                "softsync": self.softsync_size}[self.policy]

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """Build from a flat mapping (e.g. a TOML table), refusing unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training setting(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(values))
