"""Driver side of parameter-server training (``Mode.PARAMETER_SERVER``, and ``Mode.PIPELINE`` with a stage layout):
the PS in the driver, the barrier stage of PS workers (or pipeline stages), the result read off the PS."""
from __future__ import annotations

import contextlib
import secrets
import time

import numpy as np

from sparkdl._internal.modes.launch import Launch, epoch_listener, resume_checkpoint, shipped, tls_pems
from sparkdl._internal.modes.parameter_server.result import ps_result
from sparkdl._internal.modes.parameter_server.worker import ps_worker
from sparkdl._internal.modes.pipeline.worker import pipeline_worker
from sparkdl._internal.modes.progress import TrainingProgress
from sparkdl._internal.modes.result import (
    TrainResult,
)
from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.server.limits import check_ps_memory
from sparkdl._internal.ps.server.parts import PartRanges
from sparkdl._internal.ps.server.server import ParameterServer, ServerSetup
from sparkdl._internal.ps.wire.tls import server_context
from sparkdl._internal.ps.worker.remote_embedding import detach_tables
from sparkdl._internal.spark.barrier import BarrierStageRunner
from sparkdl._internal.spark.hadoop_files import checkpoint_files
from sparkdl._internal.spark.preflight import (
    bind_address,
    ps_host,
)
from sparkdl._internal.spark.task import JobSpec
from sparkdl._internal.training.flat import (
    flatten_buffers,
    flatten_parameters,
)
from sparkdl._internal.training.optim import tensor_layout
from sparkdl._internal.training.pipeline_cuts import PipelineSpec


def drive_parameter_server(launch: Launch) -> TrainResult:
    """PS policies: start the PS, run the stage (retries resume from the PS), read the result off the PS.

    With a stage ``layout`` (pipelines: ``Mode.PIPELINE``) each replica is P tasks, each pushing its stage's key range.
    The model's embedding ``tables`` are held by the PS as rows, outside the flat parameter vector.
    """
    backend, model_fn, config, template = launch.backend, launch.model_fn, launch.config, launch.template
    layout, input_args, tables = launch.layout, launch.input_args, launch.tables
    table_modules = detach_tables(template)   # the template's parameters are then the flat vector's
    initial = flatten_parameters(template)
    float_buffers = flatten_buffers(template)
    float_buffer_count = float_buffers.numel()
    check_ps_memory(config, initial.numel(), float_buffer_count, tables)
    secret = secrets.token_bytes(32)
    advertised = ps_host(backend, config.ps_host)
    parts = (None if layout is None else
             [PartRanges(p, b) for p, b in zip(layout.param_spans, layout.buffer_spans, strict=True)])
    cert_pem, key_pem = tls_pems(config)
    files = checkpoint_files(backend, config.checkpoint_dir, config.resume_from)
    ps = ParameterServer(config, initial, secret, ServerSetup(
        host=bind_address(advertised), tls=server_context(cert_pem, key_pem), float_buffer_count=float_buffer_count,
        tensor_sizes=[p.numel() for p in template.parameters()], tensor_layout=tensor_layout(template.parameters()),
        # the model's own initial rows (its init, under the run's seed), shared, not copied
        tables=[EmbeddingTable(spec, learning_rate=config.learning_rate, rows=table_modules[spec.name].weight.detach())
                for spec in tables],
        parts=parts, checkpoint_files=files,
        epoch_listener=epoch_listener(config, lambda: ps) if config.callbacks else None))
    # a stage task gets its weights from the PS, so the spec does not carry the whole model to every task
    broadcast = initial.numpy() if layout is None else np.zeros(0, dtype=np.float32)
    pipeline = None if layout is None else PipelineSpec(layout, float_buffers.numpy())
    num_tasks = config.num_workers * config.pipeline_stages
    try:
        if config.resume_from:
            ps.restore(resume_checkpoint(config, files))
        _, port = ps.start()
    except BaseException:
        ps.stop()    # its shared-memory files go with it
        raise
    description = f"policy={config.policy}, workers={config.num_workers}" + (
        f", pipeline stages={config.pipeline_stages}" if layout is not None else "")
    task = pipeline_worker if launch.mode.pipelined else ps_worker
    runner = BarrierStageRunner(backend, launch.run_barrier_stage, launch.read_chunks, task,
                                description, config.max_attempts, config.timeout_s, ps, num_tasks=num_tasks)
    barrier_started = time.perf_counter()
    progress = (TrainingProgress(ps, f"sparkdl {config.policy} x{config.num_workers}") if config.verbose
                else contextlib.nullcontext())
    try:
        with progress:
            workers = runner.run(lambda barrier_attempt: JobSpec(
                shipped(config), model_fn, broadcast, advertised, port, secret, barrier_attempt, cert_pem, pipeline,
                input_args=input_args, report_epochs=bool(config.callbacks) or config.train_step is not None,
                tables=tables))
    finally:
        ps.stop()
    if ps.failure is not None:
        raise ps.failure
    ps.write_checkpoint(final=True)   # the final state, when checkpoints are on
    stats = ps.stats
    return ps_result(config, template, workers, runner, launch.started, barrier_started, ps.final_weights(),
                      ps.core.members.reported_float_buffers(), ps.core.log, ps.core.epochs.best_validation,
                     ps.core.epochs.stopped_early, ps.events,
                      version=ps.version, samples_consumed=ps.core.members.samples_consumed,
                      peak_workers=ps.core.members.peak_workers,
                      sample_budget=ps.core.members.sample_budget, checkpoints_written=ps.checkpoints_written,
                      refused_connections=stats.auth_failures,
                      checkpoint_failures=stats.checkpoint_failures, ps_hosts="driver", ps_shards=1,
                      resumed_from_version=next((e["version"] for e in ps.events if e["event"] == "resumed"), None),
                      tables=(table_modules, ps.read(lambda core: core.final_tables())),
                      # every pushed and pulled byte crossed the driver
                      driver_bytes=sum(w["bytes_pushed"] + w["bytes_pulled"] for w in workers))
