"""Communication overlapped with computation, measured with a simulated accelerator.

    python benchmarks/overlap.py [--params 10000000] [--steps 60]

This machine has no accelerator, so the model stands in for one: 8 layers holding together
``--params`` float32 parameters, whose forward and backward *sleep* for a set time instead of
computing (as a GPU kernel leaves the CPU free) and then give every parameter a gradient (a
zero-stride scalar, so that making it costs the CPU nothing beyond accumulating it into the
flat gradient buffer, as a device's D2H copy would).  Two workers on local[2] train it against
the PS for ``--steps`` steps each: ``sync`` and ``async`` over TCP (the gradient streamed
during backward) and ``async`` through a double-buffered shared-memory segment (same host);
``--runs allreduce-gloo`` trains it under ``allreduce`` (gloo; overlapped: buckets reduced while
backward runs).
First the communication time c alone (compute 0), then compute t = 0.5c, c and 2c (one third
forward, two thirds backward), each with ``overlap_communication`` off and on.  Reports the
step time against max(t, c) (perfect overlap), and against max(t', c) where t' is the step's
measured compute time without overlap (the sleeps plus what a CPU still does around them:
accumulating gradients, the training loop); writes benchmarks/results/overlap.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import sparkdl
from sparkdl import TrainConfig, train

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 8
WIDTH = 8


class _Sleep(torch.autograd.Function):
    """y = x (+ 0 * w); forward and backward take a fixed time without using the CPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        ctx.shape = weight.shape
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, torch.tensor(1e-6).expand(ctx.shape), None, None


class SimulatedLayer(nn.Module):
    def __init__(self, params: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(params))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s)


class SimulatedModel:
    """A picklable factory of the simulated network (total params, compute seconds per step)."""

    def __init__(self, params: int, compute_s: float) -> None:
        self.params, self.compute_s = params, compute_s

    def __call__(self) -> nn.Module:
        per_layer = self.params // LAYERS
        return nn.Sequential(*[SimulatedLayer(per_layer, self.compute_s / 3 / LAYERS, 2 * self.compute_s / 3 / LAYERS)
                               for _ in range(LAYERS)])


def mean_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.mean()


def step_seconds(data, params: int, compute_s: float, policy: str, overlap: bool, steps: int,
                 transport: str) -> tuple[float, float, str]:
    """(step seconds, compute seconds per step, the transport used) of the slower worker."""
    config = TrainConfig(num_workers=2, policy=policy, epochs=1, batch_size=4, learning_rate=1e-3, loss=mean_output,
                         ps_transport="auto" if policy == "allreduce" else transport, overlap_communication=overlap,
                         timeout_s=120)
    result = train(data, SimulatedModel(params, compute_s), config)
    worker = max(result.workers, key=lambda w: (w["compute_seconds"] + w["communication_seconds"]) / w["batches"])
    return ((worker["compute_seconds"] + worker["communication_seconds"]) / worker["batches"],
            worker["compute_seconds"] / worker["batches"], worker.get("transport", "gloo"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", default="sync-tcp,sync-auto,async-tcp,async-auto",
                        help="policy-transport pairs (auto: shared memory on the PS's host)")
    args = parser.parse_args()
    spark = sparkdl.spark_session("sparkdl-overlap", master="local[2]", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rows = [(np.zeros(WIDTH, np.float32), 0.0) for _ in range(2 * 4 * args.steps)]
    data = spark.sparkContext.parallelize(rows, 2).cache()
    data.count()
    step_seconds(data, args.params, 0.0, "async", False, args.steps, "tcp")     # start the Python workers
    results = []
    for policy, transport in (run.split("-") for run in args.runs.split(",")):
        communication, _, _ = step_seconds(data, args.params, 0.0, policy, False, args.steps, transport)
        for factor in (0.5, 1.0, 2.0):
            compute = factor * communication
            plain, measured, _ = step_seconds(data, args.params, compute, policy, False, args.steps, transport)
            overlapped, _, used = step_seconds(data, args.params, compute, policy, True, args.steps, transport)
            bound, measured_bound = max(compute, communication), max(measured, communication)
            row = {"policy": policy, "transport": used, "compute_ms": 1e3 * compute,
                   "measured_compute_ms": 1e3 * measured, "communication_ms": 1e3 * communication,
                   "step_ms_plain": 1e3 * plain, "step_ms_overlapped": 1e3 * overlapped,
                   "overlapped_over_max": overlapped / bound, "plain_over_max": plain / bound,
                   "overlapped_over_measured_max": overlapped / measured_bound}
            results.append(row)
            print(f"{policy:5s} {used:13s} t = {factor:.1f}c = {1e3 * compute:6.1f} ms (measured {1e3 * measured:6.1f}),"
                  f" c = {1e3 * communication:6.1f} ms: step {1e3 * plain:6.1f} ms plain ({plain / bound:.2f} x max), "
                  f"{1e3 * overlapped:6.1f} ms overlapped ({overlapped / bound:.2f} x max(t, c), "
                  f"{overlapped / measured_bound:.2f} x max(t', c))", flush=True)
    spark.stop()
    out = ROOT / "benchmarks" / "results" / "overlap.json"
    out.write_text(json.dumps({"command": f"python benchmarks/overlap.py --params {args.params} --steps {args.steps} "
                                          f"--runs {args.runs}",
                               "rows": results}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
