"""Central PS vs executor-hosted PS shards vs ring allreduce: measured here, modelled, predicted for clusters.

    python benchmarks/scaling.py                  (after `make data`; about 15 minutes)
    python benchmarks/scaling.py --predict-only   (refit and predict from benchmarks/results/scaling.json)

1. Measure.  The 10M-parameter MLP 784-2048x3-10, sync SGD, 32 samples per worker and step,
   on local-cluster[8,1,1024] (separate executor processes), with 2, 4 and 8 workers, for
   three topologies: one PS in the driver; ``ps_shards=N`` shards hosted by the barrier tasks;
   ``policy="allreduce"`` (gloo ring).  The PS topologies use ``ps_transport="tcp"``, so every
   byte crosses a socket as it would between hosts.  Per run: the step time, split into
   compute (forward/backward) and communication (everything else: wire, aggregation,
   optimizer, waiting), the PS's apply time, bytes and messages per step.

2. Fit.  Per-parameter aggregation and optimizer costs (g, a) come straight from the PS's own
   timers.  The per-byte CPU cost of moving data through the PS's sockets (w, both ends
   together) and the per-message cost (l) are fitted by least squares to the communication
   time of the 2- and 4-worker PS runs, and gloo's per-byte cost (w_ring) to the allreduce
   runs, with this machine's model: every process shares its 2 cores, so
   ``comm = apply + (w * bytes + l * messages) / 2``.  The 8-worker runs (which
   oversubscribe the 2 cores fourfold) are predicted, not fitted, and the error is reported.

3. Predict a GPU cluster: one worker per host (8 cores each), shard i on worker host i, the
   central PS on the driver's host; NIC bandwidth B full duplex; network latency 20 us;
   PCIe 25 GB/s.  M bytes of parameters (P of them), N workers.  Per step:

   * central:   c + 2M/PCIe + max(N M / B, w N M / min(N, 8)) + g N P + a P + 2 l N / min(N, 8) + 2 lat
   * sharded:   c + 2M/PCIe + max(2 M (N-1)/N / B, w 2 M (N-1)/N / 8) + g P + a P / N + 4 l (N-1) / 8 + 2 lat
   * allreduce: c + 2 M (N-1)/N / B + 2 (N-1) lat + 16 P / (2 TB/s)     (NCCL: no host copies)

   (each end of a socket pays w/2 per byte).  The compute time c of a step is an assumption,
   not a measurement: 0.1 s for a 25M-parameter model on a GPU (batch 64), proportional to
   the parameter count.  Prints the table, the crossovers, and writes
   benchmarks/results/scaling.json and scaling.png.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
OUT = ROOT / "benchmarks" / "results" / "scaling.json"

WORKERS = (2, 4, 8)
TOPOLOGIES = ("central", "sharded", "allreduce")
BATCH_PER_WORKER = 32
STEPS = 12
CORES_HERE = 2
HOST_CORES = 8
LATENCY_S = 20e-6
PCIE_BPS = 25e9                      # host <-> GPU copies of a PS worker
GPU_MEMORY_BPS = 2e12                # a fused optimizer step on the GPU is memory-bound
GPU_OPTIMIZER_BYTES_PER_PARAMETER = 16
GPU_STEP_S_PER_PARAMETER = 0.1 / 25e6
PREDICT_WORKERS = (8, 16, 32, 64, 128, 256)
PREDICT_PARAMETERS = {"25M": 25e6, "100M": 100e6, "1B": 1e9}
PREDICT_GBITS = (10, 25, 100)


# ----------------------------------------------------------------- 1. measure
def measure() -> tuple[list[dict], int]:
    from train import read_parquet_arrays

    import sparkdl
    from sparkdl.models import mlp

    model_fn = functools.partial(mlp, 784, (2048, 2048, 2048), 10)
    parameters = sum(p.numel() for p in model_fn().parameters())
    x, y = read_parquet_arrays(str(ROOT / "data" / "mnist" / "train.parquet"))
    spark = sparkdl.spark_session("sparkdl-bench-scaling", master=f"local-cluster[{max(WORKERS)},1,1024]",
                                  conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rows = []
    for workers in WORKERS:
        rows_needed = workers * BATCH_PER_WORKER * STEPS
        data = spark.sparkContext.parallelize(list(zip(x[:rows_needed], y[:rows_needed].tolist())), workers).cache()
        data.count()
        for topology in TOPOLOGIES:
            config = sparkdl.TrainConfig(
                num_workers=workers, epochs=1, batch_size=BATCH_PER_WORKER, learning_rate=0.01, momentum=0.9,
                policy="allreduce" if topology == "allreduce" else "sync", ps_transport="tcp", timeout_s=600,
                **({"ps_shards": workers, "ps_hosts": "executors", "shard_snapshot_every": 1000}
                   if topology == "sharded" else {}))
            result = sparkdl.train(data, model_fn, config)
            rows.append(_row(topology, workers, parameters, result.summary, result.workers))
            print(json.dumps(rows[-1]), flush=True)
        data.unpersist()
    spark.stop()
    return rows, parameters


def _row(topology: str, workers: int, parameters: int, summary: dict, tasks: list[dict]) -> dict:
    steps = max(t["batches"] for t in tasks)
    step = summary["loop_seconds"] / steps
    compute = float(np.mean([t["compute_seconds"] / t["batches"] for t in tasks]))
    model_bytes = 4 * parameters
    if topology == "allreduce":   # gloo's ring: 2 (N-1)/N of the model out and in per worker; 2 (N-1) messages each
        bytes_total = 2 * 2 * model_bytes * (workers - 1)
        messages = 2 * 2 * (workers - 1) * workers
        apply = None
    else:
        bytes_total = (summary["bytes_pushed"] + summary["bytes_pulled"]) / steps
        messages = 2 * workers * summary["ps_shards"]
        apply = (summary["ps_optimizer_seconds"] + summary["ps_aggregate_seconds"]) / summary["updates"]
    return {"topology": topology, "workers": workers, "step_s": step, "compute_s": compute,
            "communication_s": step - compute, "apply_s": apply, "bytes_per_step": bytes_total,
            "messages_per_step": messages, "driver_bytes_per_step": summary.get("driver_bytes", 0) / steps,
            "ps_optimizer_s": summary.get("ps_optimizer_seconds", 0.0) / max(summary["updates"], 1),
            "ps_aggregate_s": summary.get("ps_aggregate_seconds", 0.0) / max(summary["updates"], 1)}


# ----------------------------------------------------------------- 2. fit
def apply_costs(rows: list[dict], parameters: int) -> tuple[float, float]:
    """(g, a): seconds per parameter to add one gradient, and to step the optimizer (the PS's timers)."""
    central = [r for r in rows if r["topology"] == "central"]
    a = float(np.mean([r["ps_optimizer_s"] / parameters for r in central]))
    g = float(np.mean([r["ps_aggregate_s"] / (parameters * r["workers"]) for r in central]))
    return g, a


def apply_here(row: dict, parameters: int, g: float, a: float) -> float:
    """Wall time of the updates of one step on this machine (the shards' and the replicas' share its cores)."""
    n = row["workers"]
    if row["topology"] == "central":
        return g * n * parameters + a * parameters
    if row["topology"] == "sharded":   # N shards' work, on the 2 cores
        return (g * n * parameters + a * parameters) / min(n, CORES_HERE)
    return (g * parameters + a * parameters) * n / min(n, CORES_HERE)   # every replica steps the whole model


def fit(rows: list[dict], parameters: int) -> dict:
    """Per-byte costs of the PS sockets (w, with a per-message cost l) and of gloo's ring (w_ring), from N < 8."""
    g, a = apply_costs(rows, parameters)
    fitted = [r for r in rows if r["workers"] < 8]

    def residual(r: dict) -> float:
        return r["communication_s"] - apply_here(r, parameters, g, a)

    ps_rows = [r for r in fitted if r["topology"] != "allreduce"]
    design = np.array([[r["bytes_per_step"] / CORES_HERE, r["messages_per_step"] / CORES_HERE] for r in ps_rows])
    (w, l), *_ = np.linalg.lstsq(design, np.array([residual(r) for r in ps_rows]), rcond=None)
    ring = [r for r in fitted if r["topology"] == "allreduce"]
    w_ring = sum(residual(r) * r["bytes_per_step"] for r in ring) / sum(r["bytes_per_step"] ** 2 for r in ring)
    constants = {"g_s_per_parameter": g, "a_s_per_parameter": a, "w_s_per_byte": max(float(w), 1e-12),
                 "l_s_per_message": max(float(l), 0.0), "w_ring_s_per_byte": CORES_HERE * max(float(w_ring), 1e-12)}
    checks = []
    for r in rows:
        per_byte = constants["w_ring_s_per_byte"] if r["topology"] == "allreduce" else constants["w_s_per_byte"]
        predicted = (r["compute_s"] + apply_here(r, parameters, g, a)
                     + (per_byte * r["bytes_per_step"] + constants["l_s_per_message"] * r["messages_per_step"]
                        * (r["topology"] != "allreduce")) / CORES_HERE)
        checks.append({"topology": r["topology"], "workers": r["workers"], "measured_step_s": r["step_s"],
                       "model_step_s": predicted, "error": predicted / r["step_s"] - 1, "fitted": r["workers"] < 8})
    constants["checks"] = checks
    return constants


# ----------------------------------------------------------------- 3. predict
def step_time(topology: str, n: int, parameters: float, gbit: float, constants: dict) -> float:
    """One sync step of N GPU workers, one per host (see the module docstring for the terms)."""
    g, a = constants["g_s_per_parameter"], constants["a_s_per_parameter"]
    # a socket byte costs w on this machine for both ends together; on a cluster each end pays half
    w, l = constants["w_s_per_byte"] / 2, constants["l_s_per_message"]
    m, bandwidth = 4 * parameters, gbit * 1e9 / 8
    compute = GPU_STEP_S_PER_PARAMETER * parameters
    if topology == "allreduce":   # NCCL's ring: GPU to GPU, no host copies; the optimizer steps on the GPU
        return (compute + 2 * m * (n - 1) / n / bandwidth + 2 * (n - 1) * LATENCY_S
                + GPU_OPTIMIZER_BYTES_PER_PARAMETER * parameters / GPU_MEMORY_BPS)
    host_copies = 2 * m / PCIE_BPS   # the gradient to the host, the weights back
    if topology == "central":
        return (compute + host_copies + max(n * m / bandwidth, w * 2 * n * m / min(n, HOST_CORES))
                + g * n * parameters + a * parameters + 2 * l * n / min(n, HOST_CORES) + 2 * LATENCY_S)
    share = (n - 1) / n
    return (compute + host_copies + max(2 * m * share / bandwidth, w * 4 * m * share / HOST_CORES) + g * parameters
            + a * parameters / n + 4 * l * (n - 1) / HOST_CORES + 2 * LATENCY_S)


def predict(constants: dict) -> list[dict]:
    table = []
    for name, parameters in PREDICT_PARAMETERS.items():
        for gbit in PREDICT_GBITS:
            for n in PREDICT_WORKERS:
                times = {t: step_time(t, n, parameters, gbit, constants) for t in TOPOLOGIES}
                table.append({"model": name, "gbit": gbit, "workers": n, **{f"{t}_s": v for t, v in times.items()},
                              "best": min(times, key=times.get)})
    return table


def crossovers(constants: dict) -> list[dict]:
    """Per model and bandwidth: the fewest workers (2..256) at which sharded beats central, and allreduce beats both."""
    found = []
    for name, parameters in PREDICT_PARAMETERS.items():
        for gbit in PREDICT_GBITS:
            def first(condition):
                return next((n for n in range(2, 257) if condition(n)), None)
            t = functools.partial(step_time, parameters=parameters, gbit=gbit, constants=constants)
            found.append({"model": name, "gbit": gbit,
                          "sharded_beats_central_from": first(lambda n: t("sharded", n) < t("central", n)),
                          "allreduce_beats_both_from": first(
                              lambda n: t("allreduce", n) < min(t("sharded", n), t("central", n))),
                          "sharded_beats_allreduce_from": first(lambda n: t("sharded", n) < t("allreduce", n))})
    return found


def plot(table: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PREDICT_PARAMETERS), figsize=(15, 4.5), sharey=False)
    for axis, name in zip(axes, PREDICT_PARAMETERS):
        for topology, style in zip(TOPOLOGIES, ("-", "--", ":")):
            for gbit, color in zip(PREDICT_GBITS, ("tab:red", "tab:orange", "tab:green")):
                rows = [r for r in table if r["model"] == name and r["gbit"] == gbit]
                axis.plot([r["workers"] for r in rows], [r[f"{topology}_s"] for r in rows], style, color=color,
                          label=f"{topology}, {gbit} Gbit/s")
        axis.set(title=f"{name} parameters", xscale="log", yscale="log", xlabel="workers", ylabel="step time (s)")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predict-only", action="store_true", help="reuse the measured rows in " + str(OUT))
    args = parser.parse_args()
    if args.predict_only:
        saved = json.loads(OUT.read_text())
        rows, parameters = saved["rows"], saved["parameters"]
    else:
        rows, parameters = measure()
    constants = fit(rows, parameters)
    table = predict(constants)
    found = crossovers(constants)

    print(f"\n{'topology':10s} {'N':>2s} {'step ms':>8s} {'compute':>8s} {'comm':>8s} {'apply':>7s} "
          f"{'MB/step':>8s} {'driver MB/step':>14s}")
    for r in rows:
        print(f"{r['topology']:10s} {r['workers']:2d} {1e3 * r['step_s']:8.0f} {1e3 * r['compute_s']:8.0f} "
              f"{1e3 * r['communication_s']:8.0f} {1e3 * (r['apply_s'] or 0):7.1f} {r['bytes_per_step'] / 1e6:8.0f} "
              f"{r['driver_bytes_per_step'] / 1e6:14.1f}")
    print(f"\nfitted: g={constants['g_s_per_parameter'] * 1e9:.2f} ns/param, a={constants['a_s_per_parameter'] * 1e9:.2f} "
          f"ns/param, w={constants['w_s_per_byte'] * 1e9:.3f} ns/byte, l={constants['l_s_per_message'] * 1e6:.0f} us/msg, "
          f"w_ring={constants['w_ring_s_per_byte'] * 1e9:.3f} ns/byte")
    for check in constants["checks"]:
        print(f"  {check['topology']:10s} N={check['workers']}: measured {1e3 * check['measured_step_s']:.0f} ms, "
              f"model {1e3 * check['model_step_s']:.0f} ms ({100 * check['error']:+.0f} %)"
              f"{'' if check['fitted'] else '  <- not fitted'}")
    print(f"\n{'model':5s} {'Gbit':>4s} {'N':>4s} {'central s':>10s} {'sharded s':>10s} {'allreduce s':>12s}  best")
    for r in table:
        print(f"{r['model']:5s} {r['gbit']:4d} {r['workers']:4d} {r['central_s']:10.3f} {r['sharded_s']:10.3f} "
              f"{r['allreduce_s']:12.3f}  {r['best']}")
    print("\ncrossovers (fewest workers):")
    for c in found:
        print(f"  {c['model']:5s} {c['gbit']:3d} Gbit/s: sharded < central from N={c['sharded_beats_central_from']}, "
              f"allreduce < both from N={c['allreduce_beats_both_from']}, "
              f"sharded < allreduce from N={c['sharded_beats_allreduce_from']}")
    OUT.write_text(json.dumps({"machine": platform.platform(), "parameters": parameters, "rows": rows,
                               "constants": constants, "prediction": table, "crossovers": found}, indent=2) + "\n")
    plot(table, OUT.with_suffix(".png"))
    print(f"-> {OUT}, {OUT.with_suffix('.png')}")


if __name__ == "__main__":
    main()
