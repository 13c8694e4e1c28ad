"""The one Spark-level rendezvous of a run whose tasks talk to each other with ``torch.distributed``.

Rank 0 picks a free port; one ``BarrierTaskContext.allGather`` hands it (and whatever each
task adds) to every task; then the process group forms over TCP.  No Spark call happens
per step.  On CUDA every task must hold its own GPU (NCCL refuses two ranks on one device).
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sparkdl._internal.spark.task import TaskEnv
from sparkdl.errors import ClusterConfigError

#: Linux's ioctl that reads an interface's IPv4 address
_SIOCGIFADDR = 0x8915


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def gather_places(env: TaskEnv, device: torch.device, **shared: Any) -> list[dict[str, Any]]:
    """The one ``allGather``: every task's host, device and ``shared`` values, and rank 0's free port.

    Refuses a run whose tasks mix CUDA and the CPU, or two tasks on one GPU (NCCL refuses them).
    """
    context, rank = env.context, env.rank
    infos = context.getTaskInfos()
    host = infos[env.rank].address.rsplit(":", 1)[0]
    mine = {"port": free_port() if rank == 0 else 0, "host": host, "device": str(device), **shared}
    gathered = [json.loads(m) for m in context.allGather(json.dumps(mine))]
    kinds = {g["device"].split(":")[0] for g in gathered}
    if len(kinds) > 1:
        raise ClusterConfigError(f"the tasks of one run train on {sorted(kinds)}: they must all use CUDA or all the "
                                 "CPU (give every task a GPU with spark.task.resource.gpu.amount, or set device='cpu')")
    if device.type == "cuda":
        places = [(g["host"], g["device"]) for g in gathered]
        if len(set(places)) < len(places):
            raise ClusterConfigError("two tasks of one run would share a GPU, which NCCL refuses: let Spark assign one "
                                     "GPU per task (spark.task.resource.gpu.amount=1 with a discovery script)")
        torch.cuda.set_device(device)
    return gathered


def interface_of(host: str) -> str | None:
    """The name of this machine's network interface that holds ``host``'s IPv4 address, or None
    (another system, an address on no interface here, or a name that does not resolve)."""
    try:
        address = socket.inet_aton(socket.gethostbyname(host))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):   # an interface without an IPv4 address
                    request = struct.pack("256s", name.encode()[:15])
                    if fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24] == address:
                        return name
    except (OSError, UnicodeError):
        return None
    return None


def gloo_interface(host: str, hosts: Sequence[str] = ()) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the interface of this task's Spark address, unless the user set one.

    Gloo otherwise tells its peers the address this machine's *host name* resolves to, which is
    often a loopback address (``127.0.1.1`` in ``/etc/hosts``, containers, network namespaces): the
    peers on other hosts then connect to themselves and the group never forms.  The address Spark
    reached the task at is one its peers can reach -- unless it is loopback itself while the run's
    tasks (``hosts``) are on several hosts: then gloo keeps its own choice.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    name = interface_of(host)
    if name is None or (name == "lo" and len(set(hosts)) > 1):
        return {}
    return {"GLOO_SOCKET_IFNAME": name}


@contextlib.contextmanager
def environment_set(values: Mapping[str, str]) -> Iterator[None]:
    """Set these environment variables inside the block only (Spark reuses its Python workers)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in before.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def torch_environment(rank: int, gathered: list[dict[str, Any]]) -> dict[str, str]:
    """The variables ``torchrun`` sets, for rank ``rank`` of the gathered places: ``init_process_group()``
    with its default ``env://`` then forms the group over TCP to rank 0's host and port (and gloo
    binds to the interface of this task's address, :func:`gloo_interface`)."""
    host = gathered[rank]["host"]
    on_host = [r for r, g in enumerate(gathered) if g["host"] == host]
    hosts = list(dict.fromkeys(g["host"] for g in gathered))   # in rank order: rank 0's host is group 0
    return {"MASTER_ADDR": gathered[0]["host"], "MASTER_PORT": str(gathered[0]["port"]), "RANK": str(rank),
            "WORLD_SIZE": str(len(gathered)), "LOCAL_RANK": str(on_host.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(on_host)), "GROUP_RANK": str(hosts.index(host)),
            "GROUP_WORLD_SIZE": str(len(hosts)), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(len(gathered)),
            "TORCHELASTIC_RUN_ID": "sparkdl", **gloo_interface(host, hosts)}


@contextlib.contextmanager
def process_group(env: TaskEnv, device: torch.device, timeout_s: float, **shared: Any
                  ) -> Iterator[list[dict[str, Any]]]:
    """Join the run's process group (gloo on CPU, nccl on GPU); yields every task's ``shared`` values.

    Leaving the block normally waits for every rank first, so no rank tears the group (and rank
    0's store) down while a peer still uses it; leaving on an error only tears this rank down.
    """
    gathered = gather_places(env, device, **shared)
    # read whenever a gloo group is made: this one, and the subgroups the block makes (pipelines)
    with environment_set(gloo_interface(gathered[env.rank]["host"], [g["host"] for g in gathered])):
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://{gathered[0]['host']}:{gathered[0]['port']}",
                                rank=env.rank, world_size=len(gathered), timeout=datetime.timedelta(seconds=timeout_s))
        try:
            yield gathered
            dist.barrier()
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def process_groups_outlive_their_users(settle_s: float = 0.1) -> Iterator[None]:
    """Keep every process group the block creates until the block ends; then destroy those it left.

    torch's gloo group joins its worker threads in its destructor while holding the GIL, and a
    worker thread still freeing the last collective of a backward pass needs the GIL (the work
    holds the autograd context): when the last reference to a group goes with a DDP model (the
    usual order, ``destroy_process_group()`` while the model is alive, then ``return``), the
    process deadlocks.  A ``torchrun`` process would usually exit first; a Spark task's Python
    worker lives on.  Held here, no group is destroyed before the function has returned; the
    worker threads then finish with the GIL free (``settle_s``), and only then are the groups
    released.  Groups the function did not destroy are destroyed, so the next run in this reused
    worker can ``init_process_group()`` again, as a fresh process could.
    """
    c10d = dist.distributed_c10d
    registry = getattr(c10d, "_pg_map", None)
    if type(registry) is not dict:   # another torch layout: leave it alone
        yield
        return
    kept: list[Any] = []

    class Recording(dict):
        def __setitem__(self, group: Any, value: Any) -> None:
            kept.append(group)
            super().__setitem__(group, value)

    c10d._pg_map = Recording(registry)
    try:
        yield
    finally:
        c10d._pg_map = dict(c10d._pg_map)
        left = [group for group in kept if group in c10d._pg_map]
        if left:
            with contextlib.suppress(Exception):   # a group broken by the failure being reported
                if dist.is_initialized() and dist.group.WORLD in left:
                    dist.destroy_process_group()
                else:
                    for group in left:
                        dist.destroy_process_group(group)
        if kept:
            time.sleep(settle_s)   # the GIL is free: the groups' threads finish their last works
        kept.clear()
