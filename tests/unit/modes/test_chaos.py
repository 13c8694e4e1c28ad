"""Chaos soak: many short runs against a real parameter server with faults injected at random points.

The workers are real replicas (``train_replica``) on threads, talking to a real
``ParameterServer`` over loopback; a barrier-stage attempt is emulated as Spark runs it: when
one task fails, the others of that attempt are killed (their sockets closed) and every worker
starts again with a newer task attempt id.  Faults: a worker killed (one, or both), a worker
that stalls past ``timeout_s``, a push cut mid-frame, a checkpoint write interrupted, and the
driver (the PS) killed and resumed from its newest checkpoint.

After every run: it finishes within a bound; for ``sync`` the applied updates, the data
positions and the weights equal an undisturbed run's; for async/softsync every data position
is consumed exactly once (the global sample budget spent exactly, no gradient applied twice);
checkpoints always load.
"""
from __future__ import annotations

import functools
import random
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from sparkdl._internal.data.partitions import Partition, PartitionBatches, TensorColumn
from sparkdl._internal.modes.parameter_server.worker import train_replica
from sparkdl._internal.ps.server import checkpoint as checkpoint_module
from sparkdl._internal.ps.server.checkpoint import list_checkpoints, load_latest_checkpoint
from sparkdl._internal.ps.server.server import ParameterServer
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.worker.client import PSClient
from sparkdl._internal.spark.task import JobSpec
from sparkdl._internal.training.flat import flatten_parameters
from sparkdl.config import TrainConfig
from sparkdl.models import mlp

#: the real writer, which a fault replaces for one run (the PS writes through sparkdl._internal.ps.server.checkpoint)
ORIGINAL_SAVE = checkpoint_module.save_checkpoint

pytestmark = pytest.mark.slow

MODEL = functools.partial(mlp, 64, (32,), 10)
WORKERS, EPOCHS, BATCH = 2, 2, 32
TIMEOUT_S = 2.5          # a stalled worker is declared lost after this (a sync round waits twice that)
RUN_BOUND_S = 60.0       # every run must end (finish or fail clearly) within this


class Killed(Exception):
    """The emulated death of a task's process."""


@dataclass
class Fault:
    kind: str            # kill | cut | stall | driver | checkpoint
    worker: int = 0
    at_push: int = 1     # on this worker's n-th push of the first attempt (driver: at this PS version)


@dataclass
class Outcome:
    updates: int
    positions: list[int]
    planned: list[int]
    weights: torch.Tensor
    applied: int
    accepted_rows: int
    acks: int
    attempts: int
    seconds: float
    checkpoints_ok: bool
    samples_consumed: int = 0
    sample_budget: int | None = None
    faults_fired: int = 0
    notes: list[str] = field(default_factory=list)


class FaultyClient(PSClient):
    """A PSClient that dies, stalls or cuts a frame at a chosen push."""

    def __init__(self, *args, fault: Fault | None, fired: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.fault = fault
        self.fired = fired
        self.pushes = 0
        self.acks = 0

    def push_pull(self, grads, computed_on, samples, loss, epoch, weights_out, weight=None):
        self.pushes += 1
        fault = self.fault
        if fault is not None and self.pushes == fault.at_push:
            self.fired.append(fault.kind)
            if fault.kind == "kill":
                self.sock.close()
                raise Killed(f"worker {self.worker} killed")
            if fault.kind == "cut":
                payload = memoryview(grads.numpy()).cast("B")
                head = protocol.Push(self.worker, epoch, computed_on, samples, loss, len(payload)).header()
                self.sock.sendall(protocol.pack_header(head) + bytes(payload[:len(payload) // 2]))
                self.sock.close()
                raise Killed(f"worker {self.worker} died mid-frame")
            if fault.kind == "stall":
                time.sleep(TIMEOUT_S * 1.6)    # then carry on: the PS has given up on this connection
        version, accepted = super().push_pull(grads, computed_on, samples, loss, epoch, weights_out, weight)
        self.acks += accepted
        return version, accepted


def planned_pushes(shards: list[np.ndarray], policy: str) -> list[int]:
    steps = [int(np.ceil(len(s) / BATCH)) for s in shards]
    if policy == "sync":
        steps = [max(steps)] * len(steps)
    return [s * EPOCHS for s in steps]


def run(policy: str, faults: list[Fault], x: np.ndarray, y: np.ndarray, checkpoint_dir: str,
        seed: int = 0) -> Outcome:
    """One run with ``faults`` injected in its first stage attempt (and the driver, if asked)."""
    config = TrainConfig(num_workers=WORKERS, policy=policy, softsync_size=2 if policy == "softsync" else 1,
                         epochs=EPOCHS, batch_size=BATCH, learning_rate=0.05, momentum=0.9, timeout_s=TIMEOUT_S,
                         seed=seed, checkpoint_dir=checkpoint_dir, checkpoint_every=5)
    torch.manual_seed(seed)
    initial = flatten_parameters(MODEL())
    shards = np.array_split(np.arange(len(x)), WORKERS)
    secret = secrets.token_bytes(32)
    started = time.monotonic()
    fired: list[str] = []
    driver_fault = next((f for f in faults if f.kind == "driver"), None)
    ps = ParameterServer(config, initial, secret)
    host, port = ps.start()
    acks = 0
    applied_before_resume = 0   # gradients inside the checkpoint a new driver resumed from
    attempt = 0
    try:
        while True:
            assert time.monotonic() - started < RUN_BOUND_S, "the run did not end within its bound"
            assert attempt < 8, "too many stage attempts"
            if driver_fault is not None and attempt == 0:
                watcher = threading.Thread(target=kill_driver_at, args=(ps, driver_fault.at_push, fired),
                                           daemon=True)
                watcher.start()
            spec = JobSpec(config, MODEL, initial.numpy(), host, port, secret, attempt)
            clients: dict[int, FaultyClient] = {}
            errors: dict[int, BaseException] = {}
            stage_failed = threading.Event()

            def task(rank: int) -> None:
                fault = next((f for f in faults if f.worker == rank and f.kind in ("kill", "cut", "stall")), None)
                try:
                    client = FaultyClient(host, port, secret, rank, TIMEOUT_S * 4, fault=fault if attempt == 0 else None,
                                          fired=fired)
                    clients[rank] = client
                    data = PartitionBatches(Partition((TensorColumn(torch.from_numpy(x[shards[rank]])),),
                                                      torch.from_numpy(y[shards[rank]])), torch.device("cpu"))
                    train_replica(rank, data, spec, torch.device("cpu"), client, task_attempt=attempt * 1000 + rank)
                except BaseException as exc:   # the task fails: Spark kills the rest of the stage
                    errors[rank] = exc
                    stage_failed.set()
                    for other in list(clients.values()):
                        try:
                            other.sock.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass

            threads = [threading.Thread(target=task, args=(r,), daemon=True) for r in range(WORKERS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=RUN_BOUND_S)
                assert not t.is_alive(), "a worker hung"
            acks += sum(c.acks for c in clients.values())
            if ps.failure is not None and not ps._stopping.is_set():
                raise AssertionError(f"the PS failed: {ps.failure}; the workers' errors: {errors!r}")
            if ps._stopping.is_set():   # the driver died: a new one resumes from the newest checkpoint
                ps = ParameterServer(config.replace(resume_from=checkpoint_dir), initial, secret)
                latest = load_latest_checkpoint(checkpoint_dir)
                if latest is not None:
                    ps.restore(latest)
                    applied_before_resume = latest["applied_gradients"]
                host, port = ps.start()
                acks = 0   # acknowledgements of the dead driver's gradients died with it
            elif not errors:
                break
            attempt += 1
        ps.write_checkpoint(final=True)
    finally:
        ps.stop()
    core = ps.core
    return Outcome(updates=core.stats.updates, positions=core.members.positions(),
                   planned=planned_pushes([x[s] for s in shards], policy), weights=core.weights(),
                   applied=core.stats.applied_gradients,
                   accepted_rows=applied_before_resume + sum(r.accepted for r in core.log.gradients), acks=acks,
                   attempts=attempt + 1,
                   seconds=time.monotonic() - started, checkpoints_ok=all_checkpoints_load(checkpoint_dir),
                   samples_consumed=core.members.samples_consumed, sample_budget=core.members.sample_budget, faults_fired=len(fired))


def kill_driver_at(ps: ParameterServer, version: int, fired: list[str]) -> None:
    while not ps._stopping.is_set():
        if ps.version >= version:
            fired.append("driver")
            ps.stop()    # every connection cut, no final checkpoint: as if the driver died
            return
        time.sleep(0.002)


def all_checkpoints_load(directory: str) -> bool:
    paths = list_checkpoints(directory)
    return bool(paths) and all(torch.load(p, weights_only=False)["version"] >= 0 for p in paths)


@pytest.fixture(scope="module")
def data(digits):
    x_train, _, y_train, _ = digits
    return x_train[:800], y_train[:800]


@pytest.fixture(scope="module")
def clean(data, tmp_path_factory):
    x, y = data
    return {policy: run(policy, [], x, y, str(tmp_path_factory.mktemp(f"clean-{policy}")))
            for policy in ("sync", "async", "softsync")}


def scenarios(rng: random.Random) -> list[list[Fault]]:
    """Fault sets at random points: one worker killed, both, a stall, a cut frame, the driver, a checkpoint."""
    def at() -> int:   # early enough that a worker reaches it even when the other takes most of the budget
        return rng.randint(2, 8)
    both = at()
    return [[Fault("kill", rng.randrange(WORKERS), at())],
            [Fault("kill", 0, both), Fault("kill", 1, both)],
            [Fault("stall", rng.randrange(WORKERS), at())],
            [Fault("cut", rng.randrange(WORKERS), at())],
            [Fault("driver", at_push=rng.randint(6, 20))],
            [Fault("checkpoint", at_push=rng.randint(1, 4))],
            [Fault("cut", 0, at()), Fault("driver", at_push=rng.randint(12, 22))]]


SOAK_RECORD: list[dict] = []


@pytest.mark.parametrize("policy", ["sync", "async", "softsync"])
@pytest.mark.parametrize("round_", [0, 1])
def test_chaos_soak(policy, round_, data, clean, tmp_path, monkeypatch):
    x, y = data
    rng = random.Random(f"{policy}-{round_}")
    reference = clean[policy]
    for index, faults in enumerate(scenarios(rng)):
        directory = str(tmp_path / f"ckpt-{index}")
        interrupted = next((f for f in faults if f.kind == "checkpoint"), None)
        if interrupted is not None:
            monkeypatch.setattr(checkpoint_module, "save_checkpoint", interrupting_save(interrupted.at_push))
        outcome = run(policy, faults, x, y, directory)
        monkeypatch.setattr(checkpoint_module, "save_checkpoint", ORIGINAL_SAVE)
        record = {"policy": policy, "faults": [f.kind for f in faults], "fired": outcome.faults_fired,
                  "attempts": outcome.attempts, "seconds": round(outcome.seconds, 2), "violations": []}
        SOAK_RECORD.append(record)
        violations = record["violations"]
        if not outcome.checkpoints_ok:
            violations.append("a checkpoint does not load")
        if policy == "sync":
            if outcome.positions != outcome.planned:
                violations.append(f"positions {outcome.positions} != planned {outcome.planned}")
            if outcome.updates != reference.updates:
                violations.append(f"{outcome.updates} updates, undisturbed {reference.updates}")
            if not torch.allclose(outcome.weights, reference.weights, atol=1e-5):
                violations.append("weights differ from the undisturbed run's")
        else:
            # the global sample budget is spent exactly (up to the one push that crosses it), and
            # every accepted gradient is applied once: applied == accepted, nothing twice
            budget = outcome.sample_budget
            if not budget <= outcome.samples_consumed < budget + BATCH:
                violations.append(f"{outcome.samples_consumed} samples consumed for a budget of {budget}")
            if outcome.applied != outcome.accepted_rows:
                violations.append(f"applied {outcome.applied}, accepted {outcome.accepted_rows}")
            if outcome.acks > outcome.applied:
                violations.append(f"{outcome.acks} acknowledged > {outcome.applied} applied")
        assert not violations, (faults, violations)
        # the first fault always fires (later ones may find their stage already failed)
        assert outcome.faults_fired >= 1 or interrupted, faults


def interrupting_save(nth: int):
    """save_checkpoint that dies half-way through its ``nth`` write (a temporary file is left behind)."""
    calls = [0]

    def save(directory, state, keep=3, files=checkpoint_module.LOCAL):
        calls[0] += 1
        if calls[0] == nth:
            from pathlib import Path
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / f".ckpt-{state['version']:012d}.tmp").write_bytes(b"\x80\x02half")
            raise OSError("disk full (injected)")
        return ORIGINAL_SAVE(directory, state, keep=keep, files=files)

    return save


def test_soak_summary():
    """Runs after the soak: print what it did (docs/guides/reliability.md#chaos-soak records it)."""
    if not SOAK_RECORD:
        pytest.skip("the soak did not run in this session")
    runs = len(SOAK_RECORD)
    faults = sum(len(r["faults"]) for r in SOAK_RECORD)
    retried = sum(r["attempts"] > 1 for r in SOAK_RECORD)
    violated = [r for r in SOAK_RECORD if r["violations"]]
    print(f"\nchaos soak: {runs} runs, {faults} faults, {retried} runs retried, "
          f"{len(violated)} with violations, longest {max(r['seconds'] for r in SOAK_RECORD):.1f} s")
    assert runs >= 30 and not violated
