"""Fixtures of the unit tests: one way to start a real parameter server on loopback and connect to it."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sparkdl._internal.ps.server.server import ParameterServer, ServerSetup
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl.config import TrainConfig

#: the job secret of every unit-test PS (a run draws its own; tests need one they can also get wrong)
SECRET = b"unit-test-secret".ljust(32, b"!")

_UNDER_HEADROOM = """
import resource, sys
from sparkdl.errors import ClusterConfigError
used = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + ({headroom_mb} << 20), resource.RLIM_INFINITY))
try:
    {call}
except ClusterConfigError as exc:
    print("REFUSED", exc)
    sys.exit(0)
sys.exit(3)
"""


def refused_under_headroom(setup: str, call: str, headroom_mb: int) -> str:
    """Run ``setup`` in a fresh Python, then ``call`` with only ``headroom_mb`` MB of address space left (the
    limit spark.executor.pyspark.memory sets a Python worker); returns what it printed, failing the test unless
    ``call`` was refused with a ``ClusterConfigError`` (Linux: reads ``/proc/self/status``)."""
    script = setup + _UNDER_HEADROOM.format(headroom_mb=headroom_mb, call=call)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    return done.stdout

#: what a unit-test PS runs unless a test says otherwise: one async worker, a short timeout
DEFAULT_SETTINGS: dict[str, Any] = {"num_workers": 1, "policy": "async", "learning_rate": 0.1, "timeout_s": 10}

MakeServer = Callable[..., ParameterServer]


@pytest.fixture
def make_server() -> Iterator[MakeServer]:
    """``make_server(initial=None, num_params=4, start=True, server_args=None, **settings)``: a PS, stopped after the test.

    ``initial`` (the master weights) defaults to ``num_params`` zeros; ``settings`` override
    :data:`DEFAULT_SETTINGS`; ``server_args`` go to :class:`ParameterServer` itself.
    """
    servers: list[ParameterServer] = []

    def make(initial: torch.Tensor | None = None, num_params: int = 4, start: bool = True,
             server_args: dict[str, Any] | None = None, **settings: Any) -> ParameterServer:
        config = TrainConfig(**{**DEFAULT_SETTINGS, **settings})
        weights = torch.zeros(num_params) if initial is None else initial
        server = ParameterServer(config, weights, SECRET, ServerSetup(**(server_args or {})))
        servers.append(server)
        if start:
            server.start()
        return server

    yield make
    for server in servers:
        server.stop()


def rows_steps_against(client: PSClient, reference: Any, steps: int = 3) -> None:
    """``steps`` steps of one worker on table 0 (width 3, rows 1, 4 and 9, lr 0.1) through ``client``, each pull
    checked against the EmbeddingTable ``reference``, which takes the same updates."""
    weights = torch.zeros(2)
    for step in range(steps):
        ids, grads = torch.tensor([1, 4, 9]), torch.linspace(-1, 1, 9).reshape(3, 3) * (step + 1)
        assert torch.equal(client.pull_rows(0, ids, 3), reference.gather(ids))
        client.push_rows(0, ids, grads)
        client.push_pull(torch.ones(2), step, 8, 0.0, 0, weights)
        reference.apply(ids, grads, 1.0, 0.1)       # the checked, coalescing path


def connect(server: ParameterServer, worker: int = 0, secret: bytes = SECRET, timeout: float = 10,
            **client_args: Any) -> PSClient:
    """A client of ``server`` for ``worker`` (authenticated with ``secret``)."""
    return PSClient(server.host, server.port, secret, worker, timeout, **client_args)
