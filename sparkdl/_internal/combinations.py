"""Which settings go together: every rule that relates two or more settings, in one table.

A rule names the settings it relates and returns a refusal (why, and what to set instead) or
None.  Rules of values that can never go together (``at="config"``) are checked when a
:class:`~sparkdl.config.TrainConfig` is made; the rules of a training mode (``at="launch"``:
pipelines, executor-hosted PS shards, overlapped communication) before a run starts, where
one refusal names every setting in conflict.  What depends on the cluster (free slots, task
and driver memory) is checked by the preflight (``_internal.spark.preflight``, ``_internal.ps.server.limits``).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

#: a :class:`~sparkdl.config.TrainConfig`; config.py runs the rules of its own fields, so this module
#: takes the settings by their attributes and imports nothing of it
TrainConfig = Any
#: the largest worker id a frame can name (sparkdl._internal.ps.wire.protocol.HEADER's worker field: 16 bits)
MAX_WORKER_ID = 65_535


@dataclass(frozen=True)
class Rule:
    """Settings that must agree, when the rule applies, and why they do not (None: they do)."""

    settings: tuple[str, ...]
    at: str                                            # "config" or "launch"
    applies: Callable[[TrainConfig], bool]
    refusal: Callable[[TrainConfig], str | None]

    def label(self, config: TrainConfig) -> str:
        """The settings as the user wrote them: ``overlap_communication``, ``ps_shards=2, ps_hosts='executors'``."""
        values = [(name, getattr(config, name)) for name in self.settings]
        return ", ".join(name if value is True else f"{name}={value!r}" for name, value in values)


def _backup_workers(config: TrainConfig) -> str | None:
    if config.backup_workers >= config.num_workers:
        return (f"backup_workers ({config.backup_workers}) must be below num_workers ({config.num_workers}): a sync "
                "round needs at least one gradient")
    return None


def _softsync_size(config: TrainConfig) -> str | None:
    if config.policy in ("softsync", "softsync_nodes") and config.softsync_size > config.num_workers:
        return f"softsync_size ({config.softsync_size}) must be between 1 and num_workers ({config.num_workers})"
    return None


def _early_stopping(config: TrainConfig) -> str | None:
    if config.early_stopping_patience is not None and not config.validation_fraction:
        return "early_stopping_patience needs validation data: set validation_fraction"
    return None


def _tls_pair(config: TrainConfig) -> str | None:
    if (config.tls_cert is None) != (config.tls_key is None):
        return "tls_cert and tls_key must be given together"
    return None


def _half_precision_device(config: TrainConfig) -> str | None:
    if config.precision == "16-mixed" and config.device == "cpu":
        return ("precision='16-mixed' needs a CUDA device (float16 autocast with a loss scaler); on the CPU use "
                "precision='bf16-mixed'")
    return None


def _clip_refusal(config: TrainConfig) -> str | None:
    # each shard steps its own key range: the norm of the whole gradient is nowhere at hand
    if config.ps_hosts == "executors" and config.ps_shards > 1:
        return (f"clipping needs the norm of the whole gradient, and each of the {config.ps_shards} executor-hosted "
                "PS shards (or pipeline stages' shards) sees only its key range: set ps_shards=1 or "
                "ps_hosts='driver', or grad_clip_norm=None")
    return None


def _precision_refusal(config: TrainConfig) -> str | None:
    return (f"pipeline stages train in float32: set precision='32' (or pipeline_stages=1 for "
            f"precision={config.precision!r})")


def overlap_refusal(config: TrainConfig) -> str | None:
    """Why ``overlap_communication`` cannot be used with ``config`` (None: it can)."""
    if config.policy == "allreduce":   # buckets reduced during backward; float16 unscaled after, as without overlap
        if config.local_steps != 1 or config.local_update != "accumulate":
            return "allreduce reduces gradients in buckets during the one backward pass of each step (local_steps=1)"
        return None
    if config.precision == "16-mixed":
        return ("precision='16-mixed': a streamed gradient leaves during backward, still multiplied by the loss "
                "scale (use precision='bf16-mixed' or '32')")
    if config.compression != "none":
        return "a streamed gradient is sent uncompressed (compression='none')"
    if config.local_steps != 1 or config.local_update != "accumulate":
        return "gradients are streamed from the one backward pass of each exchange (local_steps=1)"
    return None


def pipeline_refusal(config: TrainConfig) -> str | None:
    """Why ``config`` cannot train a pipeline (None: it can)."""
    import torch  # here: config.py imports this module, and a TrainConfig needs no torch

    stages, micro = config.pipeline_stages, config.micro_batches
    if not _schedules_take_what_sparkdl_passes():
        return (f"torch {torch.__version__} lacks what pipelines use in torch.distributed.pipelining (shape "
                "inference at the first step, step(return_outputs=...), scale_grads): upgrade torch")
    if config.policy != "sync":
        return (f"policy={config.policy!r}: pipelines train with policy='sync' (every stage of every replica "
                "takes part in each update; asynchronous stages would each see other versions of their "
                "neighbours)")
    if config.compression != "none" or config.overlap_communication:
        return "pipelines push uncompressed gradients after the whole schedule: set compression='none' and " \
               "overlap_communication=False"
    if config.local_steps != 1 or config.local_update != "accumulate":
        return "pipelines push after every mini-batch: set local_steps=1 and local_update='accumulate' (the " \
               "micro-batches already accumulate)"
    if config.validation_fraction:
        return "validation_fraction is not available with pipelines yet: score a held-out DataFrame with " \
               "TorchModel.transform"
    if config.batch_size % micro:
        return f"batch_size={config.batch_size} must be a multiple of micro_batches={micro}"
    if config.pipeline_schedule == "1f1b" and micro < stages:
        return (f"pipeline_schedule='1f1b' needs micro_batches >= pipeline_stages ({micro} < {stages}); raise "
                "micro_batches or use pipeline_schedule='gpipe'")
    return None


def _schedules_take_what_sparkdl_passes() -> bool:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    step = inspect.signature(ScheduleGPipe.step).parameters
    stage = inspect.signature(PipelineStage.__init__).parameters
    return ("scale_grads" in inspect.signature(ScheduleGPipe.__init__).parameters and "return_outputs" in step
            and stage["input_args"].default is None)


def fully_sharded_refusal(config: TrainConfig) -> str | None:
    """Why ``policy='fsdp'`` cannot train with ``config`` (None: it can)."""
    import torch  # here: config.py imports this module, and a TrainConfig needs no torch

    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return (f"torch {torch.__version__} lacks torch.distributed.fsdp.fully_shard (FSDP2, torch >= 2.6): upgrade "
                "torch, or use policy='allreduce'")
    if config.pipeline_stages > 1:
        return "fsdp shards every block over the workers instead of cutting the model: set pipeline_stages=1"
    if config.compression != "none":
        return "fsdp reduce-scatters its gradients uncompressed: set compression='none'"
    if config.local_update != "accumulate":
        return "fsdp steps one sharded optimizer with the workers' mean gradient: set local_update='accumulate'"
    if config.overlap_communication:
        return ("fsdp overlaps its all-gathers and reduce-scatters with compute by itself: set "
                "overlap_communication=False")
    if config.precision == "16-mixed":
        return ("fsdp's mixed precision computes in bfloat16 with float32 reduction and master weights: set "
                "precision='bf16-mixed' or '32'")
    if config.validation_fraction:
        return "validation_fraction is not available with fsdp yet: score a held-out DataFrame with TorchModel.transform"
    if config.checkpoint_dir is not None and config.local_steps > 1:
        return ("fsdp checkpoints at the end of every epoch, where gradients accumulated over local_steps may still "
                "be pending: set local_steps=1 with checkpoint_dir")
    for name in ("checkpoint_dir", "resume_from"):
        uri = getattr(config, name)
        if uri is not None and urlparse(uri).scheme not in ("", "file"):
            return (f"fsdp's workers write their sharded checkpoints into one directory themselves: set {name} to a "
                    "path all executors share (a local path in local mode, a mounted network file system)")
    return None


def shard_refusal(config: TrainConfig) -> str | None:
    """Why ``config``'s PS shards cannot be used (None: they can)."""
    if config.ps_hosts == "driver":
        if config.ps_shards > 1:
            return ("shards hosted by the driver share its one process, cores and network link (measured slower "
                    "than one driver PS); set ps_hosts='executors' to spread them over the barrier tasks")
        return None
    if config.policy in ("allreduce", "fsdp"):
        return f"policy={config.policy!r} has no parameter server"
    if config.pipeline_stages > 1:
        if config.ps_shards != config.pipeline_stages:
            return (f"a pipeline's PS is sharded by stage (stage p's parameters on the task of stage p of replica 0): "
                    f"set ps_shards={config.pipeline_stages}")
    elif config.ps_shards > config.num_workers:
        return (f"shard i is hosted by barrier task i, and there are num_workers={config.num_workers} tasks: set "
                f"ps_shards <= {config.num_workers}")
    if config.overlap_communication:
        return "overlap_communication streams one gradient into one connection: set overlap_communication=False"
    if config.backup_workers:
        return ("with backup_workers each shard would close its sync rounds with its own first gradients, mixing "
                "different workers' gradients across the model's ranges: set backup_workers=0")
    return None


def table_refusal(config: TrainConfig) -> str | None:
    """Why a model with embedding tables (``sparse=True``, held by the PS as rows) cannot train with ``config``."""
    if config.policy in ("allreduce", "fsdp"):
        return f"{config.policy} has no parameter server to hold them: use a PS policy"
    if config.pipeline_stages > 1:
        return "pipeline stages exchange activations, not rows: set pipeline_stages=1"
    if config.local_update == "sgd":
        return "local SGD pushes model deltas, tables push their rows' gradients: set local_update='accumulate'"
    if config.overlap_communication:
        return "the streamed exchange carries the dense gradient only: set overlap_communication=False"
    if config.precision == "16-mixed":
        return "the float16 loss scaler unscales the dense gradient only: use precision='bf16-mixed' or '32'"
    if config.grad_clip_norm is not None:
        return "clipping measures the dense gradient's norm, without the tables' rows: set grad_clip_norm=None"
    return None


def _shared_tables(config: TrainConfig) -> str | None:
    if config.policy != "async":
        return ("workers step shared tables as they compute, with no round or buffer (Hogwild), which only "
                "policy='async' matches: set policy='async' or shared_tables=False")
    if config.ps_hosts != "driver" or config.ps_shards > 1:
        return "the tables are shared by one PS on the driver's host: set ps_hosts='driver', ps_shards=1"
    if config.ps_transport != "auto":
        return "shared tables are shared memory, which ps_transport='tcp' turns off: set ps_transport='auto'"
    return None


def elastic_refusal(config: TrainConfig) -> str | None:
    """Why ``config`` cannot run elastic, as a plain stage whose tasks Spark re-runs one by one (None: it can)."""
    if config.policy in ("sync", "allreduce", "fsdp"):
        return (f"policy={config.policy!r} needs every worker in each round (a barrier stage): elastic runs take "
                "policy='async', 'softsync' or 'softsync_nodes'")
    if config.ps_hosts == "executors":
        return "executor-hosted PS shards live in the stage's tasks, which must run together: set ps_hosts='driver'"
    if config.sample_budget == "per_worker":
        return ("the run ends when the global sample budget is consumed, whichever tasks consume it: set "
                "sample_budget='global'")
    return None


def _min_workers(config: TrainConfig) -> str | None:
    if not config.elastic:
        return ("only an elastic run starts before every worker has a task slot (its stage is not a barrier): set "
                "elastic=True, or min_workers=None")
    if config.min_workers is not None and config.min_workers > config.num_workers:
        return f"min_workers ({config.min_workers}) cannot exceed num_workers ({config.num_workers})"
    if config.resume_from is not None:
        return ("a resumed run's sample budget would count only the rows of the workers there at the start, and "
                "the checkpoint's samples already consumed can spend it at once: set min_workers=None to resume")
    if config.ssp_bound is not None:
        return ("SSP bounds each worker's pushes since the run's start against the slowest's, so a worker that "
                "joins late would hold every other one until it had caught up: set ssp_bound=None, or "
                "min_workers=None")
    return None


def _max_workers(config: TrainConfig) -> str | None:
    assert config.max_workers is not None   # the rule applies only then
    if not config.elastic:
        return ("only an elastic run's workers come and go (its stage is not a barrier): set elastic=True, or "
                "max_workers=None")
    if config.max_workers < max(config.num_workers, config.min_workers or 0):
        return (f"max_workers ({config.max_workers}) cannot be below num_workers ({config.num_workers}) or "
                f"min_workers ({config.min_workers})")
    if config.policy != "async":
        return ("n-softsync's step takes c = lambda/n gradients from a fixed number lambda of workers, and a run "
                "with work units has as many as its executors at each moment: use policy='async', or "
                "max_workers=None")
    if config.worker_slots > MAX_WORKER_ID + 1:
        return (f"every epoch of every unit is a worker id, and epochs x 4 x max_workers = {config.worker_slots} "
                f"passes the wire's {MAX_WORKER_ID + 1}: lower epochs or max_workers")
    if config.resume_from is not None:
        return "a checkpoint keeps one data position per worker, not per work unit: set max_workers=None to resume"
    if config.ssp_bound is not None:
        return ("SSP bounds each worker's pushes against the slowest's, and a work unit's task starts after the "
                "others have pushed for a whole epoch: set ssp_bound=None, or max_workers=None")
    return None


def _callbacks_refusal(config: TrainConfig) -> str | None:
    # the callbacks run where the epochs are reduced: the parameter server on the driver
    if config.policy in ("allreduce", "fsdp"):
        return (f"callbacks are called by the parameter server on the driver, and {config.policy} has none (its "
                "epoch metrics are still in result.epochs): use a PS policy, or callbacks=[]")
    if config.ps_hosts == "executors":
        return ("callbacks are called by the parameter server on the driver; with ps_hosts='executors' the "
                "shards run on the executors: set ps_hosts='driver', or callbacks=[]")
    return None


def _implicit_momentum(config: TrainConfig) -> str | None:
    if config.policy != "async":
        return ("the momentum asynchrony adds is modelled for workers that each step the server alone: use "
                "policy='async', or implicit_momentum='ignore'")
    if config.optimizer != "sgd":
        return "it lowers SGD's momentum, which Adam has not: use optimizer='sgd', or implicit_momentum='ignore'"
    return None


def _train_step_refusal(config: TrainConfig) -> str | None:
    return ("pipeline stages compute the loss on the last stage's output with the run's loss: set "
            "train_step=None (or pipeline_stages=1)")


RULES: tuple[Rule, ...] = (
    Rule(("backup_workers", "num_workers"), "config", lambda c: True, _backup_workers),
    Rule(("softsync_size", "num_workers", "policy"), "config", lambda c: True, _softsync_size),
    Rule(("early_stopping_patience", "validation_fraction"), "config", lambda c: True, _early_stopping),
    Rule(("tls_cert", "tls_key"), "config", lambda c: True, _tls_pair),
    Rule(("precision", "device"), "config", lambda c: True, _half_precision_device),
    Rule(("implicit_momentum", "policy", "optimizer"), "launch", lambda c: c.implicit_momentum == "compensate",
         _implicit_momentum),
    Rule(("overlap_communication",), "launch", lambda c: c.overlap_communication, overlap_refusal),
    Rule(("pipeline_stages",), "launch", lambda c: c.pipeline_stages > 1, pipeline_refusal),
    Rule(("policy", "pipeline_stages", "compression", "local_update", "overlap_communication", "precision",
          "validation_fraction", "checkpoint_dir", "resume_from", "local_steps"), "launch", lambda c: c.policy == "fsdp",
         fully_sharded_refusal),
    Rule(("ps_shards", "ps_hosts"), "launch", lambda c: True, shard_refusal),
    Rule(("grad_clip_norm", "ps_shards", "ps_hosts"), "launch", lambda c: c.grad_clip_norm is not None,
         _clip_refusal),
    Rule(("precision", "pipeline_stages"), "launch", lambda c: c.precision != "32" and c.pipeline_stages > 1,
         _precision_refusal),
    Rule(("elastic", "policy", "ps_hosts", "sample_budget"), "launch", lambda c: c.elastic, elastic_refusal),
    Rule(("min_workers", "elastic", "num_workers", "ssp_bound", "resume_from"), "launch",
         lambda c: c.min_workers is not None, _min_workers),
    Rule(("max_workers", "elastic", "num_workers", "min_workers", "policy", "resume_from", "ssp_bound"), "launch",
         lambda c: c.max_workers is not None, _max_workers),
    Rule(("shared_tables", "policy", "ps_hosts", "ps_shards", "ps_transport"), "launch", lambda c: c.shared_tables,
         _shared_tables),
    Rule(("callbacks", "policy", "ps_hosts"), "launch", lambda c: bool(c.callbacks), _callbacks_refusal),
    Rule(("train_step", "pipeline_stages"), "launch", lambda c: c.train_step is not None and c.pipeline_stages > 1,
         _train_step_refusal),
)


def check_combinations(config: TrainConfig, at: str) -> None:
    """Raise ``ValueError`` on the first rule of stage ``at`` that ``config`` breaks, naming its settings."""
    for rule in RULES:
        if rule.at != at or not rule.applies(config):
            continue
        refusal = rule.refusal(config)
        if refusal is None:
            continue
        if at == "config":
            raise ValueError(f"TrainConfig.{refusal}")
        raise ValueError(f"TrainConfig.{rule.label(config)} cannot be used here: {refusal}")
