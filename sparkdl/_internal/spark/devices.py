"""Spark-assigned GPU resources -> torch devices."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from sparkdl.errors import ClusterConfigError


def gpu_addresses(resources: Mapping[str, object]) -> list[str]:
    """The GPU addresses Spark assigned to this task (``TaskContext.resources()``)."""
    info = resources.get("gpu") if resources else None
    return list(getattr(info, "addresses", []) or []) if info is not None else []


def cuda_index(address: str, visible_devices: str | None) -> int:
    """Map a Spark GPU address to a CUDA ordinal of this process.

    Spark's discovery scripts report physical ids.  When ``CUDA_VISIBLE_DEVICES`` is set the
    process sees only those devices, renumbered from 0, so the ordinal is the address's
    position in that list.
    """
    if visible_devices:
        visible = [v.strip() for v in visible_devices.split(",") if v.strip()]
        if address in visible:
            return visible.index(address)
        if len(visible) == 1:   # the cluster manager already isolated this task's GPU
            return 0
        raise ValueError(f"Spark assigned GPU {address!r} but CUDA_VISIBLE_DEVICES={visible_devices!r} hides it")
    return int(address)


def select_device(requested: str, addresses: Sequence[str]) -> torch.device:
    """The device a task trains on: its Spark-assigned GPU, else CPU (``requested='auto'``).

    A GPU is made this process's current device, in every mode: pinned host memory, streams, events and
    ``torch.cuda`` calls without a device then use it, not GPU 0 (where each task would open a context)."""
    if requested == "cpu":
        return torch.device("cpu")
    if addresses:
        if not torch.cuda.is_available():
            raise ClusterConfigError(f"Spark assigned GPU(s) {list(addresses)} to this task but torch sees no CUDA "
                               "device; install a CUDA build of torch on the executors")
        return _current(torch.device("cuda", cuda_index(addresses[0], os.environ.get("CUDA_VISIBLE_DEVICES"))))
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ClusterConfigError("device='cuda' but no GPU is visible to this task; set "
                               "'spark.task.resource.gpu.amount' or use device='auto'")
        return _current(torch.device("cuda", 0))
    return torch.device("cpu")


def _current(device: torch.device) -> torch.device:
    torch.cuda.set_device(device)
    return device
