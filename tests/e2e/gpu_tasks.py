"""Barrier tasks on local-cluster with fake GPUs from a discovery script (as Spark's own tests do).

Prints one JSON line: per task, the GPU addresses Spark assigned and the CUDA ordinals sparkdl
maps them to; and the error train() gives on this machine, whose torch sees no CUDA device.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import sparkdl
from sparkdl import TrainConfig, train
from sparkdl._internal.spark.devices import cuda_index, gpu_addresses
from sparkdl.models import mlp


def tasks(_rows):
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    addresses = gpu_addresses(context.resources())
    yield {"partition": context.partitionId(), "addresses": addresses,
           "ordinal": cuda_index(addresses[0], None),
           "ordinal_with_visible_devices": cuda_index(addresses[0], "7,1,0")}


def main() -> None:
    script = Path(sys.argv[1])
    script.write_text('#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    script.chmod(0o755)
    spark = sparkdl.spark_session("sparkdl-fake-gpus", master="local-cluster[1,2,1024]", conf={
        "spark.ui.enabled": "false",
        "spark.worker.resource.gpu.amount": "2",
        "spark.worker.resource.gpu.discoveryScript": str(script),
        "spark.executor.resource.gpu.amount": "2",
        "spark.task.resource.gpu.amount": "1",
    })
    spark.sparkContext.setLogLevel("ERROR")
    sc = spark.sparkContext
    seen = sc.parallelize(range(2), 2).barrier().mapPartitions(tasks).collect()
    rows = [(np.ones(8, dtype=np.float32), 0)] * 20
    try:
        train(sc.parallelize(rows, 2), lambda: mlp(8, (4,), 2), TrainConfig(epochs=1, max_attempts=1))
        error = None
    except sparkdl.SparkDLError as exc:
        error = str(exc)
    print("RESULT " + json.dumps({"tasks": seen, "train_error": error}))
    spark.stop()


if __name__ == "__main__":
    main()
