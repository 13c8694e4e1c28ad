"""Each mode's driver side without Spark: the mode table, and every driver run against a local barrier stage
(real task bodies in spawned processes, the real parameter server, shard coordinator or process group), checked
against single-process big-batch SGD."""
from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl._internal.data.checks import DataRules
from sparkdl._internal.data.rows import row_chunks
from sparkdl._internal.mode import Mode
from sparkdl._internal.modes import launcher
from sparkdl._internal.modes.allreduce.driver import drive_allreduce
from sparkdl._internal.modes.executor_shards.driver import drive_executor_shards
from sparkdl._internal.modes.fully_sharded.driver import drive_fully_sharded
from sparkdl._internal.modes.launch import Launch
from sparkdl._internal.modes.parameter_server.driver import drive_parameter_server
from sparkdl._internal.training.pipeline_cuts import build_whole, lay_out_stages
from sparkdl.config import TrainConfig
from tests.reference import largest_difference, single_process_sgd
from tests.unit.modes.local_stage import LocalBackend, local_barrier_stage

ROWS, FEATURES, CLASSES, BATCH = 32, 6, 3, 8
SETTINGS = {"num_workers": 2, "policy": "sync", "epochs": 2, "batch_size": BATCH, "optimizer": "sgd",
            "learning_rate": 0.2, "momentum": 0.0, "shuffle": False, "seed": 3, "timeout_s": 60, "verbose": False}


def model_fn() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def data_parts(parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS * parts, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=ROWS * parts).astype(np.int64)
    return [(x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS]) for i in range(parts)]


def rows_of(part: tuple[np.ndarray, np.ndarray]) -> list[tuple[np.ndarray, int]]:
    return [(features, int(label)) for features, label in zip(*part, strict=True)]


def launch_of(config: TrainConfig, partitions: list[list], backend: LocalBackend) -> Launch:
    torch.manual_seed(config.seed)
    template, from_factories = build_whole(model_fn)
    layout = lay_out_stages(template, config.pipeline_stages, None, from_factories) if config.mode.pipelined else None
    return Launch(backend, model_fn, config, local_barrier_stage(partitions),
                  functools.partial(row_chunks, rules=DataRules()), template, time.perf_counter(), layout)


def expected(parts: list[tuple[np.ndarray, np.ndarray]], config: TrainConfig) -> dict:
    _, final = single_process_sgd(model_fn, parts, BATCH, ROWS // BATCH, config.epochs, config.learning_rate,
                                  config.seed)
    return final


@pytest.mark.parametrize("policy, ps_hosts, stages, mode", [
    ("sync", "driver", 1, Mode.PARAMETER_SERVER), ("async", "executors", 1, Mode.EXECUTOR_SHARDS),
    ("sync", "driver", 2, Mode.PIPELINE), ("sync", "executors", 2, Mode.PIPELINE_EXECUTOR_SHARDS),
    ("allreduce", "driver", 1, Mode.ALLREDUCE), ("fsdp", "driver", 1, Mode.FULLY_SHARDED)])
def test_the_settings_choose_one_mode_and_every_mode_has_a_driver(policy, ps_hosts, stages, mode):
    config = TrainConfig(num_workers=2, policy=policy, ps_hosts=ps_hosts, pipeline_stages=stages)
    assert config.mode is mode and Mode.of(policy, ps_hosts, stages) is mode
    assert set(launcher.DRIVERS) == set(Mode)
    assert mode.has_parameter_server == (policy not in ("allreduce", "fsdp"))
    assert mode.executor_shards == (ps_hosts == "executors") and mode.pipelined == (stages > 1)


def test_the_launcher_hands_the_run_to_its_modes_driver(monkeypatch):
    called: list[Launch] = []
    monkeypatch.setattr(launcher, "check_cluster", lambda *args, **kwargs: None)
    monkeypatch.setitem(launcher.DRIVERS, Mode.PIPELINE, lambda launch: called.append(launch) or "result")
    config = TrainConfig(num_workers=1, policy="sync", pipeline_stages=2)
    assert launcher._train(LocalBackend(), model_fn, config, local_barrier_stage([[]]), row_chunks) == "result"
    (launch,) = called
    assert launch.mode is Mode.PIPELINE and launch.layout is not None and launch.layout.num_stages == 2


@pytest.mark.parametrize("driver, settings", [
    (drive_parameter_server, {}),
    (drive_executor_shards, {"ps_hosts": "executors"}),
    (drive_allreduce, {"policy": "allreduce"}),
    (drive_allreduce, {"policy": "allreduce", "overlap_communication": True}),
    (drive_fully_sharded, {"policy": "fsdp"})],
    ids=["parameter_server", "executor_shards", "allreduce", "allreduce-overlapped", "fsdp"])
def test_each_modes_driver_trains_as_single_process_big_batch_sgd(driver, settings):
    config = TrainConfig(**{**SETTINGS, **settings})
    parts = data_parts(2)
    backend = LocalBackend()
    result = driver(launch_of(config, [rows_of(p) for p in parts], backend))
    assert largest_difference(result.state_dict, expected(parts, config)) < 1e-5
    assert result.summary["mode"] == config.mode.value and result.summary["attempts"] == 1
    assert len(result.workers) == 2 and backend.shared == backend.released == 1
    if config.policy == "allreduce":    # both tasks on this host: shared memory, unless buckets are asked for
        assert {w["reduction"] for w in result.workers} == {"gloo" if config.overlap_communication else "shared_memory"}


@pytest.mark.parametrize("driver, policy", [(drive_allreduce, "allreduce"), (drive_fully_sharded, "fsdp")])
def test_accumulating_two_batches_a_step_is_big_batch_sgd(driver, policy):
    config = TrainConfig(**{**SETTINGS, "policy": policy, "local_steps": 2})
    parts = data_parts(2)
    result = driver(launch_of(config, [rows_of(p) for p in parts], LocalBackend()))
    _, final = single_process_sgd(model_fn, parts, 2 * BATCH, ROWS // BATCH // 2, config.epochs,
                                  config.learning_rate, config.seed)
    assert largest_difference(result.state_dict, final) < 1e-5
    if policy == "allreduce":
        assert {w["reduction"] for w in result.workers} == {"shared_memory"}


def test_allreduce_with_local_sgd_averages_the_models_of_the_workers_own_steps():
    """Model averaging: from a common model, each worker takes 2 SGD steps on its own batches; the mean is next."""
    config = TrainConfig(**{**SETTINGS, "policy": "allreduce", "local_steps": 2, "local_update": "sgd"})
    parts = data_parts(2)
    result = drive_allreduce(launch_of(config, [rows_of(p) for p in parts], LocalBackend()))
    torch.manual_seed(config.seed)
    anchor = model_fn()
    tensors = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in parts]
    for _ in range(config.epochs):
        for first in range(0, ROWS // BATCH, 2):
            replicas = []
            for x, y in tensors:
                replica = model_fn()
                replica.load_state_dict(anchor.state_dict())
                optimizer = torch.optim.SGD(replica.parameters(), lr=config.learning_rate)
                for k in (first, first + 1):
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(replica(x[k * BATCH:(k + 1) * BATCH]),
                                                y[k * BATCH:(k + 1) * BATCH]).backward()
                    optimizer.step()
                replicas.append(replica.state_dict())
            anchor.load_state_dict({k: (replicas[0][k] + replicas[1][k]) / 2 for k in replicas[0]})
    assert largest_difference(result.state_dict, anchor.state_dict()) < 1e-5


def test_the_pipeline_modes_driver_trains_its_stages_as_one_process():
    config = TrainConfig(**{**SETTINGS, "num_workers": 1, "pipeline_stages": 2})
    parts = data_parts(1)
    result = drive_parameter_server(launch_of(config, [rows_of(parts[0]), []], LocalBackend()))
    assert largest_difference(result.state_dict, expected(parts, config)) < 1e-5
    assert result.summary["mode"] == "pipeline" and sorted(w["pipeline_stage"] for w in result.workers) == [0, 1]
