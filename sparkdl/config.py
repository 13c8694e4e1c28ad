"""Validated, immutable training configuration shared by the driver and the executors.

:class:`TrainConfig` is the one table of training settings: every field is declared once
with :func:`setting` (default, help text, validation and its pyspark.ml Param name).  The
estimator's Params (``sparkdl.ml._params``), the job's ``--set train.<field>=...`` and the
settings reference ``docs/reference/settings.md`` (:func:`settings_markdown`, rewritten by
``python -m sparkdl._internal.settings_page``)
are all derived from it.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sparkdl._internal.combinations import check_combinations
from sparkdl._internal.mode import Mode

__all__ = [
    "TrainConfig", "UNITS_PER_WORKER", "POLICIES", "OPTIMIZERS", "LOSSES", "STALENESS_LR", "DEVICES",
    "COMPRESSIONS", "NONFINITE", "LOCAL_UPDATES", "SAMPLE_BUDGETS", "LR_SCHEDULES", "LR_SCALINGS",
    "IMPLICIT_MOMENTUM", "EMBEDDING_OPTIMIZERS", "DATA_CACHES", "PS_TRANSPORTS", "PS_HOSTS",
    "PIPELINE_SCHEDULES", "PRECISIONS",
]

POLICIES = ("sync", "async", "softsync", "softsync_nodes", "allreduce", "fsdp")
OPTIMIZERS = ("sgd", "adam", "adamw")
LOSSES = ("cross_entropy", "mse", "bce_with_logits")
STALENESS_LR = ("none", "inverse")
DEVICES = ("auto", "cpu", "cuda")
COMPRESSIONS = ("none", "fp16", "int8", "topk")
NONFINITE = ("skip", "fail")
LOCAL_UPDATES = ("accumulate", "sgd")
SAMPLE_BUDGETS = ("global", "per_worker")
#: an elastic run with max_workers cuts its input into this many work units per worker it may have: enough that
#: a worker that arrives mid-epoch finds unread units, few enough that a unit's pass outweighs its task's start
UNITS_PER_WORKER = 4
LR_SCHEDULES = ("constant", "step", "cosine")
LR_SCALINGS = ("none", "linear")
IMPLICIT_MOMENTUM = ("auto", "ignore", "compensate")
#: sparkdl._internal.ps.server.embedding_table.ROW_OPTIMIZERS, and "auto"
EMBEDDING_OPTIMIZERS = ("auto", "sgd", "adagrad", "lazy_adam")
DATA_CACHES = ("auto", "memory", "disk")
PS_TRANSPORTS = ("auto", "tcp")
PS_HOSTS = ("driver", "executors")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("32", "bf16-mixed", "16-mixed")

#: key of a field's declaration in ``dataclasses.Field.metadata``
_SETTING = "sparkdl.setting"
#: the value types a field may declare (optionally ``| None``), and how errors name them
_TYPE_NAMES: dict[type, str] = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


# --------------------------------------------------------------------------- validation rules
@dataclass(frozen=True)
class Check:
    """A rule on one field's value; ``requirement`` completes "TrainConfig.<field> must be ...".

    ``test`` only sees values of the field's declared type (never None).  ``choices`` lists
    the allowed values when the rule is a fixed set, for the documentation.
    """

    test: Callable[[Any], bool]
    requirement: str
    choices: tuple[Any, ...] = ()


def one_of(*allowed: Any) -> Check:
    """The value must be one of ``allowed``."""
    return Check(lambda value: value in allowed, f"one of {allowed}", allowed)


def greater_than(low: float) -> Check:
    """The value must be strictly above ``low``."""
    return Check(lambda value: value > low, f"> {low}")


def at_least(low: float) -> Check:
    """The value must be ``low`` or above."""
    return Check(lambda value: value >= low, f">= {low}")


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Check:
    """The value must lie in the interval from ``low`` to ``high`` (closed unless said otherwise)."""
    def test(value: Any) -> bool:
        return (low < value if low_open else low <= value) and (value < high if high_open else value <= high)

    return Check(test, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")


positive_int = Check(lambda value: value >= 1, "a positive integer")
non_negative_int = Check(lambda value: value >= 0, "an integer >= 0")
callable_or_reference = Check(lambda value: callable(value) or (isinstance(value, str) and ":" in value),
                              "a callable or its 'module:qualname' text")
epoch_callbacks = Check(lambda value: isinstance(value, (list, tuple))
                        and all(callable(getattr(c, "on_epoch_end", None)) or (isinstance(c, str) and ":" in c)
                                for c in value),
                        "a list of objects with an on_epoch_end(epoch, metrics) method (or 'module:qualname' texts "
                        "naming such objects or classes)")
loss_name_or_callable = Check(lambda value: value in LOSSES if isinstance(value, str) else callable(value),
                              f"one of {LOSSES} or a callable", LOSSES)


# --------------------------------------------------------------------------- the declarations
def setting(default: Any, help: str, *, param: str | None = None, internal: str | None = None,
            check: Check | None = None, scoring: bool = False) -> Any:
    """Declare one :class:`TrainConfig` field: its default, help text, validation and exposure.

    Exactly one of ``param`` (the pyspark.ml Param name on TorchEstimator) and ``internal``
    (why the field is not a Param) must be given.  ``scoring=True`` marks a Param that the
    fitted TorchModel has too, because it also matters when scoring.
    """
    if (param is None) == (internal is None):
        raise TypeError("setting() needs exactly one of param= (the Param name) or internal= (the reason)")
    declaration = {"help": help, "param": param, "internal": internal, "check": check, "scoring": scoring}
    return dataclasses.field(default=default, metadata={_SETTING: declaration})


@dataclass(frozen=True)
class Setting:
    """One row of the settings table: a :class:`TrainConfig` field and how it is exposed."""

    name: str
    #: bool, int, float or str; None: any value that ``check`` accepts (the loss)
    value_type: type | None
    #: None is a valid value
    optional: bool
    default: Any
    help: str
    #: pyspark.ml Param name on TorchEstimator (None for an internal field)
    param: str | None
    #: why the field is not a Param (None for a Param)
    internal: str | None
    check: Check | None
    #: the Param is also one of the fitted TorchModel's
    scoring: bool

    def describe(self, quote: Callable[[Any], str] = repr) -> str:
        """The help text, followed by the allowed values when they are a fixed set."""
        choices = self.check.choices if self.check else ()
        if not choices:
            return self.help
        names = [quote(choice) for choice in choices]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        return f"{self.help} ({listed})"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides the data and the model factory.

    ``batch_size`` is per worker: one optimizer update in ``sync`` mode sees
    ``num_workers * batch_size * local_steps`` samples.  Every field is validated on
    construction; :func:`settings` lists them with their Param names and help texts.
    """

    num_workers: int = setting(2, "model replicas = barrier tasks = data partitions", param="numWorkers",
                               check=positive_int)
    epochs: int = setting(5, "passes over every partition", param="epochs", check=positive_int)
    batch_size: int = setting(32, "mini-batch size per worker", param="batchSize", check=positive_int)
    pipeline_stages: int = setting(1, "model parallelism: model_fn's nn.Sequential (or list of stage factories) is "
                                   "cut into P stages, one barrier task each, so a run takes num_workers x P tasks; "
                                   "1: data parallelism only", param="pipelineStages", check=positive_int)
    micro_batches: int = setting(4, "pipelines: micro-batches each mini-batch is split into (m; batch_size must be "
                                 "a multiple of it)", param="microBatches", check=positive_int)
    pipeline_schedule: str = setting("1f1b", "pipelines: 'gpipe' runs all forwards, then all backwards; '1f1b' "
                                     "(PipeDream-flush) interleaves them, so a stage holds at most P micro-batches' "
                                     "activations (needs micro_batches >= P)", param="pipelineSchedule",
                                     check=one_of(*PIPELINE_SCHEDULES))
    pipeline_cuts: str | None = setting(None, "pipelines: indices of the layers that begin stages 2..P, e.g. '3,6' "
                                        "(None: balanced by parameter count)", param="pipelineCuts")
    policy: str = setting("sync", "how pushed gradients become parameter-server updates; 'allreduce': no parameter "
                          "server, replicas average their gradients; 'fsdp': no parameter server, each worker holds "
                          "1/N of the parameters, gradients and optimizer state (fully sharded data parallelism)",
                          param="updatePolicy", check=one_of(*POLICIES))
    shard_blocks: str | None = setting(None, "fsdp: class names of the modules sharded as one block each, e.g. "
                                       "'TransformerBlock,Embedding' (a block's full parameters are gathered only while "
                                       "it computes); None: every module held directly in an nn.Sequential or "
                                       "nn.ModuleList", param="shardBlocks")
    softsync_size: int = setting(1, "softsync: gradients from any workers averaged into one update (c); "
                                 "softsync_nodes: distinct workers per update (n); 1 <= c, n <= N",
                                 param="softsyncSize", check=positive_int)
    local_steps: int = setting(1, "mini-batches per push, s (see local_update)", param="localSteps",
                               check=positive_int)
    local_update: str = setting("accumulate", "what a worker does with its s mini-batches: 'accumulate' averages "
                                "their gradients (same weights); 'sgd' takes s local optimizer steps and pushes "
                                "the model delta (local SGD, delayed update)", param="localUpdate",
                                check=one_of(*LOCAL_UPDATES))
    staleness_lr: str = setting("none", "staleness-aware rate: 'inverse' multiplies a gradient of staleness "
                                "tau >= 1 by 1/tau before it enters the optimizer", param="stalenessLr",
                                check=one_of(*STALENESS_LR))
    max_staleness: int | None = setting(None, "gradients staler than this many versions are dropped "
                                        "(None: no bound)", param="maxStaleness", check=non_negative_int)
    ssp_bound: int | None = setting(None, "stale synchronous parallel: a worker more than this many pushes ahead "
                                    "of the slowest active worker waits for it (async/softsync; None: no bound)",
                                    param="sspBound", check=non_negative_int)
    backup_workers: int = setting(0, "sync: a round completes with the first N - b gradients; later ones for that "
                                  "round are dropped", param="backupWorkers", check=non_negative_int)
    sample_budget: str = setting("global", "async/softsync: 'global' trains until epochs x dataset size samples "
                                 "have been consumed by all workers together (fast workers keep drawing from "
                                 "their partition); 'per_worker': every worker passes its own partition epochs times",
                                 param="sampleBudget", check=one_of(*SAMPLE_BUDGETS))
    optimizer: str = setting("sgd", "optimizer applied on the parameter server (and by allreduce and local-SGD "
                             "workers); 'adamw' is Adam with decoupled weight decay (Loshchilov & Hutter 2019)",
                             param="optimizer", check=one_of(*OPTIMIZERS))
    embedding_optimizer: str = setting("auto", "the row-wise optimizer of the model's embedding tables "
                                       "(nn.Embedding/nn.EmbeddingBag built with sparse=True, which the parameter "
                                       "server holds as rows): 'sgd' (no momentum or weight decay), 'adagrad' or "
                                       "'lazy_adam' (torch.optim.SparseAdam's rule); 'auto': 'sgd' with "
                                       "optimizer='sgd', 'lazy_adam' with 'adam' and 'adamw'",
                                       param="embeddingOptimizer", check=one_of(*EMBEDDING_OPTIMIZERS))
    learning_rate: float = setting(0.01, "base learning rate alpha0", param="learningRate", check=greater_than(0))
    momentum: float = setting(0.0, "SGD momentum", param="momentum", check=between(0, 1, high_open=True))
    implicit_momentum: str = setting("auto", "async with SGD: 'compensate' lowers the parameter server's explicit "
                                     "momentum by the momentum that asynchrony itself adds (about 1 - 1/N with N "
                                     "workers, Mitliagkas et al. 2016), so that both together match 'momentum'; "
                                     "'ignore' applies 'momentum' as set; 'auto' compensates where it applies "
                                     "(policy='async' with optimizer='sgd') and ignores elsewhere",
                                     param="implicitMomentum", check=one_of(*IMPLICIT_MOMENTUM))
    weight_decay: float = setting(0.0, "weight decay: L2 (added to the gradient) for 'sgd' and 'adam'; decoupled "
                                  "for 'adamw' (w <- w x (1 - lr x weight_decay) before each Adam step)",
                                  param="weightDecay", check=at_least(0))
    decay_all_parameters: bool = setting(False, "adamw: decay every parameter; by default 1-D parameters (biases, "
                                         "normalisation-layer weights) are left out of the weight decay",
                                         param="decayAllParameters")
    grad_clip_norm: float | None = setting(None, "clip the gradient to this global L2 norm before every optimizer "
                                           "step (torch.nn.utils.clip_grad_norm_'s rule): on the PS the averaged "
                                           "gradient of each update, as the optimizer applies it; under allreduce "
                                           "the averaged gradient, on every worker; under local_update='sgd' each "
                                           "local step's gradient (None: no clipping; not with several "
                                           "executor-hosted PS shards)", param="gradClipNorm", check=greater_than(0))
    lr_schedule: str = setting("constant", "learning rate per PS version: 'step' multiplies by lr_step_gamma "
                               "every lr_step_every updates, 'cosine' decays to 0 over the planned updates",
                               param="lrSchedule", check=one_of(*LR_SCHEDULES))
    lr_warmup_updates: int = setting(0, "updates of linear warm-up from alpha/warmup to alpha", param="lrWarmupUpdates",
                                     check=non_negative_int)
    lr_step_every: int = setting(1000, "step schedule: updates between two decays", param="lrStepEvery",
                                 check=positive_int)
    lr_step_gamma: float = setting(0.1, "step schedule: decay factor", param="lrStepGamma",
                                   check=between(0, 1, low_open=True))
    lr_scaling: str = setting("none", "'linear' multiplies alpha0 by the samples of one update over batch_size "
                              "(Goyal et al. 2017)", param="lrScaling", check=one_of(*LR_SCALINGS))
    loss: str | Callable[..., Any] = setting("cross_entropy", "loss function: a name or a callable "
                                             "loss(output, target)", param="loss", check=loss_name_or_callable,
                                             scoring=True)
    seed: int = setting(0, "initial weights and per-epoch partition shuffles", param="seed")
    shuffle: bool = setting(True, "reshuffle every worker's partition at each epoch (deterministic given seed)",
                            param="shuffle")
    timeout_s: float = setting(300.0, "bound, in seconds, on every blocking wait (PS rounds, worker replies, "
                               "rendezvous)", param="timeout", check=greater_than(0))
    ps_host: str | None = setting(None, "address the workers connect to for the parameter server (None: "
                                  "127.0.0.1 under a local master, else spark.driver.host, and under Spark "
                                  "Connect the client's own address; set it when that address is not reachable "
                                  "from executors)",
                                  param="psHost")
    ps_port: int = setting(0, "port of the parameter server on the driver (0: any free port)", param="psPort",
                           check=between(0, 65535))
    ps_transport: str = setting("auto", "how workers on the parameter server's host exchange gradients and "
                                "weights: 'auto' through a shared-memory segment (uncompressed gradients; the socket "
                                "carries only control messages), 'tcp' always over the socket", param="psTransport",
                                check=one_of(*PS_TRANSPORTS))
    ps_threads: int = setting(1, "intra-op threads of the parameter server's tensor work (its optimizer step, "
                              "aggregation), per connection; 1 leaves the cores to workers that share the PS's "
                              "host (on 2 cores a second thread made async 15% slower); raise it for a driver "
                              "with idle cores and a large model", param="psThreads", check=positive_int)
    shared_tables: bool = setting(False, "embedding tables (sparse=True) in shared memory on the parameter "
                                  "server's host: the workers there read their rows and step them in place, "
                                  "lock-free (Hogwild, Recht et al. 2011), with no message for rows; workers on "
                                  "other hosts send theirs as before. policy='async' with one PS on the driver and "
                                  "ps_transport='auto'; the staleness factors and max_staleness act on the dense "
                                  "gradient only", param="sharedTables")
    ps_shards: int = setting(1, "split the parameter server into this many key-range shards, each applying the "
                             "policy and the optimizer to its range (with ps_hosts='executors': at most num_workers; "
                             "fewer when the model has under 1024 parameters per shard)", param="psShards",
                             check=positive_int)
    ps_hosts: str = setting("driver", "where the parameter server runs: 'driver' (one PS in the driver process) or "
                            "'executors' (shard i in barrier task i; the driver only coordinates and keeps "
                            "snapshots)", param="psHosts", check=one_of(*PS_HOSTS))
    shard_snapshot_every: int = setting(50, "ps_hosts='executors': updates between two snapshots of every shard "
                                        "sent to the driver; a failed stage resumes from the newest snapshot all "
                                        "shards reached (sync: exact; async: at most this many updates redone)",
                                        param="shardSnapshotEvery", check=positive_int)
    overlap_communication: bool = setting(False, "stream each gradient to the PS while backward produces it; "
                                          "under sync, stream the new weights into the next forward, layer by "
                                          "layer (across hosts, CPU replicas); under async/softsync, start the "
                                          "next mini-batch while the reply travels (its gradient is then one "
                                          "update staler; on the PS's host through double-buffered shared "
                                          "memory, GPU replicas too); under allreduce, reduce the gradient in "
                                          "buckets while backward runs (as DDP); uncompressed, local_steps=1",
                                          param="overlapCommunication")
    device: str = setting("auto", "where training and scoring run: 'auto' is the Spark-assigned GPU if any, "
                          "else the CPU", param="device", check=one_of(*DEVICES), scoring=True)
    precision: str = setting("32", "the workers' forward and loss, and scoring's forward: '32' in float32; "
                             "'bf16-mixed' under torch.autocast in bfloat16 (CPU and CUDA); '16-mixed' in float16 "
                             "with a loss scaler (training on CUDA only: steps whose gradient overflows are skipped "
                             "and counted as amp_skipped_steps). Parameters, gradients and the PS stay float32",
                             param="precision", check=one_of(*PRECISIONS), scoring=True)
    compression: str = setting("none", "gradient compression on the push, with error feedback for the lossy ones",
                               param="compression", check=one_of(*COMPRESSIONS))
    topk_ratio: float = setting(0.01, "topk: fraction of the gradient's entries sent per push (above 0.5 "
                                "top-k sends more bytes than the dense gradient)", param="topkRatio",
                                check=between(0, 0.5, low_open=True))
    checkpoint_dir: str | None = setting(None, "directory for parameter-server checkpoints: a path of the driver, or "
                                         "a Hadoop file system URI (hdfs://, s3a://, file:// ...; None: none are "
                                         "written); under fsdp every worker writes its shards there at the end of "
                                         "each epoch, so a path all executors share", param="checkpointDir")
    checkpoint_every: int = setting(100, "updates between two checkpoints (one is always written at the end)",
                                    param="checkpointEvery", check=positive_int)
    checkpoint_keep: int = setting(3, "newest checkpoints kept; older ones are deleted", param="checkpointKeep",
                                   check=positive_int)
    resume_from: str | None = setting(None, "continue from the newest complete checkpoint in this directory, a path "
                                      "or a Hadoop file system URI (driver restart; None: start fresh)",
                                      param="resumeFrom")
    max_attempts: int = setting(3, "barrier-stage attempts before the run fails (a retry continues from the "
                                "PS's state)", param="maxAttempts", check=positive_int)
    elastic: bool = setting(False, "async/softsync/softsync_nodes with the driver's PS: the workers run as a plain "
                            "(non-barrier) stage, so a task lost with its executor is re-run by Spark alone (up to "
                            "spark.task.maxFailures) and resumes at its data position while the others keep "
                            "training; the run needs min_workers task slots at its start", param="elastic")
    min_workers: int | None = setting(None, "elastic runs: the workers that must have started before training "
                                      "begins (None: num_workers); the others join as their tasks get task slots "
                                      "(executors added mid-run: dynamic allocation, a new worker), each training "
                                      "its own partition, and the sample budget grows by epochs x its rows",
                                      param="minWorkers", check=positive_int)
    max_workers: int | None = setting(None, "elastic async runs: the most workers that train at once (None: "
                                      "num_workers, which stays the number started); with it the input is cut "
                                      "into 4 x max_workers work units and every epoch of a unit is one Spark "
                                      "task, so executors added mid-run take the next unread units",
                                      param="maxWorkers", check=positive_int)
    nonfinite: str = setting("skip", "gradients with NaN/Inf: 'skip' refuses and counts them, 'fail' stops the run",
                             param="nonfinite", check=one_of(*NONFINITE))
    tls_cert: str | None = setting(None, "PEM certificate file for TLS between workers and the PS (with tls_key; "
                                   "None: plain TCP)", param="tlsCert")
    tls_key: str | None = setting(None, "PEM private-key file of tls_cert", param="tlsKey")
    verbose: bool = setting(False, "show live progress on the driver (a bar in terminals and notebooks, a "
                            "plain line every few seconds in logs)", param="verbose")
    validation_fraction: float = setting(0.0, "hold out this fraction of every worker's partition (seeded) and score "
                                         "it on the executors every validation_every epochs", param="validationFraction",
                                         check=between(0, 0.5, high_open=False))
    validation_every: int = setting(1, "epochs between two validations", param="validationEvery", check=positive_int)
    early_stopping_patience: int | None = setting(None, "stop once the validation loss has not improved by "
                                                  "early_stopping_min_delta for this many validations (None: never)",
                                                  param="earlyStoppingPatience", check=positive_int)
    early_stopping_min_delta: float = setting(0.0, "smallest decrease of the validation loss that counts as an "
                                              "improvement", param="earlyStoppingMinDelta", check=at_least(0))
    restore_best_weights: bool = setting(True, "with validation, end with the weights of the best validation loss, "
                                         "not the last ones", param="restoreBestWeights")
    data_cache: str = setting("auto", "where a worker keeps its partition: 'memory' (on the training device when "
                              "numeric), 'disk' (streamed to executor-local disk and read back a batch at a time, "
                              "with bounded memory), 'auto' (memory while the partition is under a quarter of the "
                              "task's share of the host's available memory, else disk)", param="dataCache",
                              check=one_of(*DATA_CACHES))
    batch_transform: Callable[..., Any] | str | None = setting(
        None, "callable(features, generator) -> float tensor, applied to every mini-batch on the workers "
        "(decoding, normalisation, augmentation; generator is seeded per worker, epoch and step, and None when "
        "scoring); a 'module:qualname' text names one", param="batchTransform", check=callable_or_reference,
        scoring=True)
    train_step: Callable[..., Any] | str | None = setting(
        None, "callable(model, inputs, label, weight) -> the loss, or a dict with 'loss' and metrics, run on the "
        "workers instead of loss(model(*inputs), label) (inputs: the tuple of input tensors, or a dict by inputArgs "
        "with ragged inputs' masks as <arg>_mask; weight: the rows' weights, None without weightCol); its metrics "
        "are averaged per epoch over the workers on the driver (result.epochs); a 'module:qualname' text names one",
        param="trainStep", check=callable_or_reference)
    callbacks: tuple[Any, ...] = setting(
        (), "objects whose on_epoch_end(epoch, metrics) the driver calls once every worker finished the epoch "
        "(metrics: the mean training loss, the trainStep's metrics, val_loss and val_metric when validated); one "
        "returning True stops training as early stopping does (the parameter server on the driver only); a "
        "'module:qualname' text names an object, or a class made without arguments",
        param="callbacks", check=epoch_callbacks)
    pad_value: float = setting(0.0, "the value that pads ragged inputs (array columns of varying length among "
                               "inputCols) to the longest row of each mini-batch", param="padValue", scoring=True)
    sequence_length: int | None = setting(None, "ragged inputs: refuse rows longer than this (before any update), "
                                          "and pad every mini-batch to exactly this length instead of its longest "
                                          "row (pipelines need it: their stages fix activation shapes at the first "
                                          "step)", param="sequenceLength", check=positive_int, scoring=True)
    ps_memory_limit_mb: float | None = setting(None, "refuse, before launch, a run whose parameter server would "
                                               "need more driver memory than this many MB (None: 80% of the "
                                               "driver machine's available memory)", param="psMemoryLimitMb",
                                               check=greater_than(0))

    def __post_init__(self) -> None:
        for spec in settings():
            value = getattr(self, spec.name)
            normalized = validate_setting(spec, value)
            if isinstance(normalized, list):     # a list of callbacks: a tuple, so that configs compare and hash
                normalized = tuple(normalized)
            if normalized is not value:
                object.__setattr__(self, spec.name, normalized)
        # the rules that relate several fields (those of a training mode are checked at launch)
        check_combinations(self, at="config")

    @property
    def mode(self) -> Mode:
        """The training mode these settings choose (``sparkdl._internal.mode``): the one reading of ``policy``,
        ``ps_hosts`` and ``pipeline_stages`` that decides which code path runs."""
        return Mode.of(self.policy, self.ps_hosts, self.pipeline_stages)

    @property
    def work_units(self) -> int:
        """Work units of an elastic run with ``max_workers`` (0: none, each worker trains its own partition)."""
        return UNITS_PER_WORKER * self.max_workers if self.max_workers is not None else 0

    @property
    def worker_slots(self) -> int:
        """The parameter server's worker ids: one per worker, or (work units) one per unit and epoch."""
        return self.epochs * self.work_units if self.work_units else self.num_workers

    @property
    def gradients_per_update(self) -> int:
        """How many pushed gradients the PS averages into one optimizer step."""
        return {"sync": self.num_workers - self.backup_workers, "allreduce": self.num_workers,
                "fsdp": self.num_workers, "async": 1,
                "softsync": self.softsync_size, "softsync_nodes": self.softsync_size}[self.policy]

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Build from a flat mapping (e.g. a TOML table), refusing unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training setting(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(values))

    def to_json_dict(self) -> dict[str, Any]:
        """Every field as a JSON value; a callable loss becomes its ``module:qualname`` text.

        TLS settings are the file paths as given: the certificate and key are never read here.
        """
        return {spec.name: _json_value(getattr(self, spec.name)) for spec in settings()}


# --------------------------------------------------------------------------- table helpers
_INVALID = object()


def validate_setting(spec: Setting, value: Any, given: Any = _INVALID) -> Any:
    """``value`` as the field ``spec`` keeps it (builtin types), or ``ValueError`` naming the field.

    TrainConfig runs it on every field, and the estimator's Params when a value is set, so
    both refuse a value with the same message.  ``given``: the value as the user wrote it, for
    the message, when ``value`` is already converted (a Param's type converter ran first).
    """
    if value is None and spec.optional:
        return value
    shown = value if given is _INVALID else given
    none_or = "None or " if spec.optional else ""
    normalized = _normalize(value, spec.value_type)
    if normalized is _INVALID:
        assert spec.value_type is not None   # _normalize passes every value when there is no type
        raise ValueError(f"TrainConfig.{spec.name} must be {none_or}{_TYPE_NAMES[spec.value_type]}, got {shown!r}")
    if spec.check is not None and not spec.check.test(normalized):
        raise ValueError(f"TrainConfig.{spec.name} must be {none_or}{spec.check.requirement}, got {shown!r}")
    return normalized


def _normalize(value: Any, kind: type | None) -> Any:
    """``value`` as the builtin ``kind`` (numpy numbers, paths), or ``_INVALID``.

    Builtin types keep the config picklable and JSON-clean, and let pyspark's Param
    converters accept every valid value.
    """
    if kind is None:
        return value
    if kind is bool:
        return value if isinstance(value, bool) else _INVALID
    if isinstance(value, bool):     # True is an int to Python, never a count or a rate here
        return _INVALID
    if kind is int:
        return int(value) if isinstance(value, numbers.Integral) else _INVALID
    if kind is float:
        return float(value) if isinstance(value, numbers.Real) else _INVALID
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value if isinstance(value, str) else _INVALID


def _value_type(hint: Any) -> tuple[type | None, bool]:
    """(value type, None allowed) of a field annotation such as ``int | None``."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = typing.get_args(hint) if union else (hint,)
    others = [member for member in members if member is not type(None)]
    kind = others[0] if len(others) == 1 and others[0] in _TYPE_NAMES else None
    return kind, len(others) < len(members)


@functools.cache
def settings() -> tuple[Setting, ...]:
    """Every :class:`TrainConfig` field with its declaration, in declaration order."""
    hints = typing.get_type_hints(TrainConfig)
    rows = []
    for field in dataclasses.fields(TrainConfig):
        if _SETTING not in field.metadata:
            raise TypeError(f"TrainConfig.{field.name} must be declared with setting()")
        value_type, optional = _value_type(hints[field.name])
        rows.append(Setting(name=field.name, value_type=value_type, optional=optional, default=field.default,
                            **field.metadata[_SETTING]))
    return tuple(rows)


def _json_value(value: Any) -> Any:
    """A field's value as JSON: callables by ``module:qualname``, callback objects by their class."""
    if callable(value):
        return callable_name(value)
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int, float, str)):
        return [callable_name(type(item)) for item in value]
    return value


def callable_name(fn: Any) -> str:
    """``module:qualname`` of a function, class or callable object (partials name their function)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}"


def _markdown_value(value: Any) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def settings_markdown() -> str:
    """The settings table (field, Param, default, meaning) as markdown, for docs/reference/settings.md."""
    lines = ["| field | Param | default | meaning |", "|---|---|---|---|"]
    for spec in settings():
        param = f"`{spec.param}`" if spec.param else f"— (internal: {spec.internal})"
        if spec.scoring:
            param += " (also TorchModel)"
        meaning = spec.describe(quote=lambda choice: f"`{choice}`")
        lines.append(f"| `{spec.name}` | {param} | {_markdown_value(spec.default)} | {meaning} |")
    return "\n".join(lines)
