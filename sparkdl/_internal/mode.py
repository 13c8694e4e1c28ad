"""The training mode: how a run's replicas share what they learn, decided once from the settings.

Three settings choose it -- ``policy`` (``"allreduce"`` and ``"fsdp"``: no parameter server), ``ps_hosts``
(``"executors"``: the PS split into key ranges the barrier tasks host) and ``pipeline_stages``
(> 1: each replica is cut into that many barrier tasks) -- and this module is the one place
that reads them for that purpose: everything else asks ``config.mode``.  Which setting
combinations are refused stays with the settings' rules (``sparkdl._internal.combinations``).
The mode's value is what the run summary shows as ``mode``.
"""
from __future__ import annotations

import enum


class Mode(enum.Enum):
    """A training mode; each has one driver (``sparkdl._internal.modes.launcher.DRIVERS``)."""

    #: one parameter server in the driver, one barrier task per replica
    PARAMETER_SERVER = "parameter_server"
    #: the parameter server split into key-range shards hosted by the barrier tasks; the driver coordinates
    EXECUTOR_SHARDS = "executor_shards"
    #: replicas cut into pipeline stages (one barrier task each), the parameter server in the driver
    PIPELINE = "pipeline"
    #: pipeline stages whose parameter server shards (one per stage) are hosted by the barrier tasks
    PIPELINE_EXECUTOR_SHARDS = "pipeline_executor_shards"
    #: no parameter server: the replicas average their gradients with torch.distributed
    ALLREDUCE = "allreduce"
    #: no parameter server: each replica holds 1/N of the parameters, gradients and optimizer state (FSDP)
    FULLY_SHARDED = "fully_sharded"

    @classmethod
    def of(cls, policy: str, ps_hosts: str, pipeline_stages: int) -> Mode:
        """The mode these settings choose (they are validated together by the settings' rules)."""
        if policy == "allreduce":
            return cls.ALLREDUCE
        if policy == "fsdp":
            return cls.FULLY_SHARDED
        shards = ps_hosts == "executors"
        if pipeline_stages > 1:
            return cls.PIPELINE_EXECUTOR_SHARDS if shards else cls.PIPELINE
        return cls.EXECUTOR_SHARDS if shards else cls.PARAMETER_SERVER

    @property
    def has_parameter_server(self) -> bool:
        """Whether a parameter server (in the driver or on the executors) holds the master weights."""
        return self not in (Mode.ALLREDUCE, Mode.FULLY_SHARDED)

    @property
    def executor_shards(self) -> bool:
        """Whether the parameter server's shards live in the barrier tasks (the driver only coordinates)."""
        return self in (Mode.EXECUTOR_SHARDS, Mode.PIPELINE_EXECUTOR_SHARDS)

    @property
    def pipelined(self) -> bool:
        """Whether each replica spans several barrier tasks, one per pipeline stage."""
        return self in (Mode.PIPELINE, Mode.PIPELINE_EXECUTOR_SHARDS)
