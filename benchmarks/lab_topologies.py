"""The driver PS, executor-hosted PS shards and allreduce measured across hosts of the multi-host lab.

    python benchmarks/lab_topologies.py              (root, after `make data`; about 25 minutes)
    python benchmarks/lab_topologies.py --labs 1gbit:3   (one lab again; the others' recorded runs stay)
    python benchmarks/lab_topologies.py --fit-only   (refit from benchmarks/results/lab_topologies.json)
    python benchmarks/lab_topologies.py --timeline --labs 1gbit:2 --models 10M 50M
                                                     (where each step's time goes: busy and idle links)

1. Measure.  On the lab (tests/e2e/lab.py: every host a network namespace, every link rate-limited
   both ways, the driver on a host of its own), at 1 Gbit/s and 100 Mbit/s with 2 and 3 worker
   hosts (one one-core Spark worker each), sync SGD on MLPs of 1M, 10M and 50M parameters (50M at
   1 Gbit/s only: at 100 Mbit/s one step of the driver PS moves 2.4 GB through its link), 32 samples
   per worker and step, for the driver PS, ``ps_shards=N`` shards hosted by the tasks, and allreduce
   (gloo).  Each configuration trains twice in one application, S and S + K steps; the differences
   give the step time and the bytes each host's link carried per step (Spark's start-up, the
   broadcast of the initial weights and the final collect cancel out).

2. Model.  A step of sync SGD is a push phase, then a pull phase (no worker pulls before the round
   is complete), each bounded by its busiest link, plus the compute of a step and a CPU term::

       step = c + kappa_topology * L / B
       L = 2 N M        (driver PS: N pushes into the driver's link, then N pulls out of it)
       L = 2 M (N-1)/N  (shards and allreduce: each host sends and receives (N-1)/N of the model per phase)

   with M = 4 P bytes, B the link's rate, c the measured forward/backward time.  kappa_topology
   (how much longer than the link's rate allows a topology's bytes take: TCP and tbf overheads,
   phases that do not overlap perfectly, the CPU of the 2 shared cores) is fitted by least squares
   on the 1M and 10M points, weighted by 1 / step; the 50M points are held out and their prediction
   error reported.  The naive bound of the driver PS, N M each way over its full-duplex link
   (pushes and pulls overlapping), is reported next to it.

Writes benchmarks/results/lab_topologies.json and prints the table, the fit and the crossovers.

3. Timeline (``--timeline``).  The same fits with every link's counters sampled every 5 ms (in the
   switch's namespace, all links at once).  A link direction is *busy* in a sample interval when it
   carried at least half its rate's bytes; per extra step (long fit minus short, as above) it gives
   each direction's busy time and the time when no link was busy.  Writes
   benchmarks/results/lab_link_timeline.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
OUT = ROOT / "benchmarks" / "results" / "lab_topologies.json"
TIMELINE_OUT = ROOT / "benchmarks" / "results" / "lab_link_timeline.json"
#: a link direction is busy in a sample interval that carried at least this share of the link's rate
BUSY_SHARE = 0.5

#: hidden widths of the 784-...-10 MLPs: 1.07M, 10.0M and 51.2M parameters
MODELS = {"1M": (1024, 256), "10M": (2048, 2048, 2048), "50M": (4864, 4864, 4864)}
TOPOLOGIES = ("central", "sharded", "allreduce")
BATCH_PER_WORKER = 32
SHORT_STEPS = 2
LABS = (("1gbit", 2), ("1gbit", 3), ("100mbit", 2), ("100mbit", 3))
RATE_BPS = {"1gbit": 1e9 / 8, "100mbit": 100e6 / 8}
HELD_OUT = "50M"


def extra_steps(model: str, rate: str) -> int:
    """K: enough steps that the difference dwarfs the noise, few enough for the slow links."""
    return {"1M": 10, "10M": 6, "50M": 4}[model] if rate == "1gbit" else {"1M": 8, "10M": 3}[model]


def models_for(rate: str, chosen: list[str] | None = None) -> list[str]:
    return [m for m in (list(MODELS) if rate == "1gbit" else ["1M", "10M"]) if chosen is None or m in chosen]


# ----------------------------------------------------------------- 1. measure (the driver program)
def drive(args: argparse.Namespace) -> None:
    """On the lab's driver host: every configuration at S and S + K steps, each fit between two handshakes
    with the measuring process (which reads the links' counters while the driver waits)."""
    from train import read_parquet_arrays

    import sparkdl
    from sparkdl.models import mlp

    spark = sparkdl.spark_session("sparkdl-bench-lab", master=args.master, conf={
        "spark.driver.host": args.driver_host, "spark.driver.bindAddress": args.driver_host,
        "spark.ui.enabled": "false", "spark.executor.cores": "1",
        # allreduce and the executor-hosted shards bring the final weights back as task results, through
        # the executors' and the driver's JVMs: 1g JVMs run out of memory on the 50M model
        "spark.executor.memory": "2g", "spark.driver.memory": "3g",
        "spark.cores.max": str(args.workers)})
    spark.sparkContext.setLogLevel("ERROR")
    x, y = read_parquet_arrays(str(ROOT / "data" / "mnist" / "train.parquet"))
    handshake = Path(args.handshake)
    index = 0
    for model in models_for(args.rate, args.models):
        model_fn = functools.partial(mlp, 784, MODELS[model], 10)
        parameters = sum(p.numel() for p in model_fn().parameters())
        for topology in TOPOLOGIES:
            for steps in (SHORT_STEPS, SHORT_STEPS + extra_steps(model, args.rate)):
                rows = args.workers * BATCH_PER_WORKER * steps
                data = spark.sparkContext.parallelize(list(zip(x[:rows], y[:rows].tolist())), args.workers)
                config = sparkdl.TrainConfig(
                    num_workers=args.workers, epochs=1, batch_size=BATCH_PER_WORKER, learning_rate=0.01,
                    momentum=0.9, shuffle=False, timeout_s=900, seed=0,
                    policy="allreduce" if topology == "allreduce" else "sync",
                    **({"ps_shards": args.workers, "ps_hosts": "executors", "shard_snapshot_every": 100000}
                       if topology == "sharded" else {}))
                (handshake / f"ready-{index}").write_text("")
                while not (handshake / f"go-{index}").exists():
                    time.sleep(0.05)
                result = sparkdl.train(data, model_fn, config)
                row = {"model": model, "parameters": parameters, "topology": topology, "workers": args.workers,
                       "rate": args.rate, "steps": max(t["batches"] for t in result.workers),
                       "loop_seconds": result.summary["loop_seconds"],
                       "compute_seconds_per_batch": float(np.mean([t["compute_seconds"] / t["batches"]
                                                                   for t in result.workers])),
                       "transports": sorted({t.get("transport", "gloo") for t in result.workers})}
                (handshake / f"done-{index}.json").write_text(json.dumps(row))
                index += 1
    (handshake / "finished").write_text("")
    spark.stop()


def wait_for(driver: subprocess.Popen, log: Path, *paths: Path) -> Path:
    """The first of ``paths`` the driver program writes; the end of its log if it stops before."""
    while True:
        for path in paths:
            if path.exists():
                return path
        if driver.poll() is not None:
            raise RuntimeError(f"the driver program ended before writing {paths[0].name}:\n" + log.read_text()[-4000:])
        time.sleep(0.05)


def measure_lab(rate: str, workers: int, models: list[str] | None = None, timeline: bool = False) -> list[dict]:
    """Start a lab, run the driver program on its driver host, read every link around every fit (and
    sample them all through it, with ``timeline``)."""
    import contextlib
    import tempfile

    from lab import Lab

    runs = []
    with Lab(workers=workers, rate=rate) as lab:
        handshake = Path(tempfile.mkdtemp(prefix="sdlab-bench-"))
        log = lab.logs / "bench-driver.log"
        driver = lab.start_driver([sys.executable, str(Path(__file__).resolve()), "--drive", "--master", lab.master_url,
                                   "--driver-host", lab.driver.address, "--workers", str(workers),
                                   "--rate", rate, "--handshake", str(handshake),
                                   *(["--models", *models] if models else [])], log)
        index = 0
        while wait_for(driver, log, handshake / f"ready-{index}", handshake / "finished").name != "finished":
            sampled = lab.timeline(lab.hosts) if timeline else contextlib.nullcontext({})
            with lab.carried(lab.hosts) as carried, sampled as samples:
                (handshake / f"go-{index}").write_text("")
                done = wait_for(driver, log, handshake / f"done-{index}.json")
            row = json.loads(done.read_text())
            row["link_bytes"] = carried
            if timeline:
                row["link_busy"] = busy_times(samples, RATE_BPS[rate])
            runs.append(row)
            print(json.dumps(row), flush=True)
            index += 1
        driver.wait(timeout=120)
    return runs


def busy_times(samples: dict[str, Any], rate_bps: float) -> dict[str, Any]:
    """Seconds each link direction was busy (carried ≥ BUSY_SHARE of its rate in a sample interval), seconds
    when none was, and the sampled window, from ``Lab.timeline``'s samples."""
    t = np.asarray(samples["t"])
    dt = np.diff(t)
    busy = {}
    for name, ways in samples.items():
        if name == "t":
            continue
        for way, counts in ways.items():
            busy[f"{name} {way}"] = np.diff(np.asarray(counts, dtype=np.float64)) >= BUSY_SHARE * rate_bps * dt
    any_busy = np.logical_or.reduce(list(busy.values()))
    return {"window_s": float(t[-1]), "none_busy_s": float(dt[~any_busy].sum()),
            "busy_s": {key: float(dt[mask].sum()) for key, mask in busy.items()},
            "interval_s": float(np.median(dt))}


def per_step_busy(runs: list[dict]) -> list[dict]:
    """Per extra step (long fit minus short): each link direction's busy seconds and the seconds no link was busy."""
    points = []
    for short, long in pairs(runs):
        extra = long["steps"] - short["steps"]
        busy = {key: (long["link_busy"]["busy_s"][key] - short["link_busy"]["busy_s"][key]) / extra
                for key in long["link_busy"]["busy_s"]}
        points.append({key: long[key] for key in ("rate", "workers", "model", "topology")} | {
            "step_s": (long["loop_seconds"] - short["loop_seconds"]) / extra,
            "compute_s": long["compute_seconds_per_batch"],
            "none_busy_s": (long["link_busy"]["none_busy_s"] - short["link_busy"]["none_busy_s"]) / extra,
            "busy_s": busy, "interval_s": long["link_busy"]["interval_s"]})
    return points


def pairs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """(short fit, long fit) of every configuration measured at both lengths."""
    found = []
    for key in sorted({(r["rate"], r["workers"], r["model"], r["topology"]) for r in runs}):
        pair = sorted((r for r in runs if (r["rate"], r["workers"], r["model"], r["topology"]) == key),
                      key=lambda r: r["steps"])
        if len(pair) == 2:        # not a lab that failed part-way
            found.append((pair[0], pair[1]))
    return found


def report_busy(points: list[dict]) -> None:
    print(f"{'rate':>8} {'N':>2} {'model':>5} {'topology':>9} {'step s':>7} {'compute':>7} {'no link':>7}  "
          "busy s per step (host direction)")
    for p in points:
        busiest = sorted(p["busy_s"].items(), key=lambda kv: -kv[1])
        print(f"{p['rate']:>8} {p['workers']:>2} {p['model']:>5} {p['topology']:>9} {p['step_s']:7.3f} "
              f"{p['compute_s']:7.3f} {p['none_busy_s']:7.3f}  " + ", ".join(f"{k} {v:.3f}" for k, v in busiest))


def per_step(runs: list[dict]) -> list[dict]:
    """One point per configuration: the long fit minus the short one, per extra step."""
    points = []
    for short, long in pairs(runs):
        rate, workers, model, topology = long["rate"], long["workers"], long["model"], long["topology"]
        extra = long["steps"] - short["steps"]
        links = {name: {way: (long["link_bytes"][name][way] - short["link_bytes"][name][way]) / extra
                        for way in ("sent", "received")} for name in long["link_bytes"]}
        busiest = max(max(v.values()) for v in links.values())
        points.append({"rate": rate, "workers": workers, "model": model, "parameters": long["parameters"],
                       "topology": topology, "step_s": (long["loop_seconds"] - short["loop_seconds"]) / extra,
                       "compute_s": long["compute_seconds_per_batch"], "link_bytes_per_step": links,
                       "busiest_link_bytes_per_step": busiest, "transports": long["transports"]})
    return points


# ----------------------------------------------------------------- 2. model
def link_bytes_model(topology: str, workers: int, parameters: float) -> float:
    """L: the bytes a step moves through its busiest link, summed over its two phases (push, then pull)."""
    model_bytes = 4 * parameters
    if topology == "central":
        return 2 * workers * model_bytes
    return 2 * model_bytes * (workers - 1) / workers


def naive_bound(point: dict) -> float:
    """The driver PS's step if pushes and pulls overlapped on its full-duplex link: N M each way, plus compute."""
    return point["compute_s"] + point["workers"] * 4 * point["parameters"] / RATE_BPS[point["rate"]]


def fit(points: list[dict]) -> dict:
    """kappa per topology: least squares on the points not held out, relative (each weighted by 1 / step)."""
    constants = {}
    for topology in TOPOLOGIES:
        fitted = [p for p in points if p["model"] != HELD_OUT and p["topology"] == topology]
        link = np.array([link_bytes_model(topology, p["workers"], p["parameters"]) / RATE_BPS[p["rate"]] / p["step_s"]
                         for p in fitted])
        target = np.array([(p["step_s"] - p["compute_s"]) / p["step_s"] for p in fitted])
        constants[f"kappa_{topology}"] = float(link @ target / (link @ link))
    for p in points:
        p["model_step_s"] = predict(p["topology"], p["workers"], p["parameters"], p["rate"], p["compute_s"],
                                    constants)
        p["link_bound_s"] = p["compute_s"] + link_bytes_model(p["topology"], p["workers"], p["parameters"]) \
            / RATE_BPS[p["rate"]]
        p["error"] = p["model_step_s"] / p["step_s"] - 1
        p["held_out"] = p["model"] == HELD_OUT
        if p["topology"] == "central":
            p["naive_bound_s"] = naive_bound(p)
    return constants


def predict(topology: str, workers: int, parameters: float, rate: str, compute_s: float, constants: dict) -> float:
    return compute_s + constants[f"kappa_{topology}"] * link_bytes_model(topology, workers, parameters) / RATE_BPS[rate]


def report(points: list[dict], constants: dict) -> None:
    print("\n" + "   ".join(f"kappa_{t} {constants[f'kappa_{t}']:.3f}" for t in TOPOLOGIES))
    print(f"{'rate':>8} {'N':>2} {'model':>5} {'topology':>9} {'step s':>8} {'bound s':>8} {'model s':>8} "
          f"{'error':>7} {'compute':>8} {'busiest MB':>10}  transports")
    for p in points:
        print(f"{p['rate']:>8} {p['workers']:>2} {p['model']:>5} {p['topology']:>9} {p['step_s']:8.3f} "
              f"{p['link_bound_s']:8.3f} {p['model_step_s']:8.3f} {p['error']:+7.1%}"
              f"{'*' if p['held_out'] else ' '}{p['compute_s']:8.3f} "
              f"{p['busiest_link_bytes_per_step'] / 1e6:10.1f}  {','.join(p['transports'])}")
    print("(* held out of the fit)")
    for rate, workers in sorted({(p["rate"], p["workers"]) for p in points}):
        for model in MODELS:
            chosen = {p["topology"]: p for p in points
                      if (p["rate"], p["workers"], p["model"]) == (rate, workers, model)}
            if len(chosen) < len(TOPOLOGIES):
                continue
            best = min(chosen.values(), key=lambda p: p["step_s"])
            central = chosen["central"]
            print(f"{rate} {workers} hosts {model}: fastest {best['topology']}; driver PS / shards "
                  f"{central['step_s'] / chosen['sharded']['step_s']:.2f}x measured, "
                  f"{central['model_step_s'] / chosen['sharded']['model_step_s']:.2f}x modelled; driver PS "
                  f"{central['step_s']:.3f} s against the overlapped bound {central['naive_bound_s']:.3f} s")


def timeline(args: argparse.Namespace) -> None:
    """The fits again with every link sampled: where each step's time goes."""
    from lab import Lab

    reason = Lab.missing()
    if reason:
        raise SystemExit(f"no lab on this machine: {reason}")
    labs = [(rate, int(workers)) for rate, workers in (lab.split(":") for lab in args.labs)]
    runs = []
    for rate, workers in labs:
        runs += measure_lab(rate, workers, args.models, timeline=True)
    report_busy(per_step_busy(runs))
    command = "python benchmarks/lab_topologies.py --timeline --labs " + " ".join(args.labs) + (
        " --models " + " ".join(args.models) if args.models else "")
    # the labs measured now replace their recorded runs; the others' stay, with the commands that made them
    recorded = json.loads(TIMELINE_OUT.read_text()) if TIMELINE_OUT.exists() else {"runs": []}
    commands = {**recorded.get("commands", {}), **{f"{rate}:{workers}": command for rate, workers in labs}}
    runs = [run for run in recorded["runs"] if (run["rate"], run["workers"]) not in labs] + runs
    TIMELINE_OUT.parent.mkdir(exist_ok=True)
    TIMELINE_OUT.write_text(json.dumps({"commands": commands, "busy_share": BUSY_SHARE, "runs": runs,
                                        "points": per_step_busy(runs)}, indent=1))
    print(f"wrote {TIMELINE_OUT.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit-only", action="store_true", help="refit from the recorded measurements")
    parser.add_argument("--labs", nargs="+", default=[f"{rate}:{workers}" for rate, workers in LABS],
                        help="RATE:WORKER_HOSTS of the labs to measure (default: all four); the others' "
                             "recorded runs are kept")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="only these models (default: all)")
    parser.add_argument("--timeline", action="store_true",
                        help="sample every link every 5 ms: busy and idle time per step (to lab_link_timeline.json)")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--driver-host", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rate", help=argparse.SUPPRESS)
    parser.add_argument("--handshake", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(args)
        return
    if args.timeline:
        timeline(args)
        return
    recorded = json.loads(OUT.read_text())["runs"] if OUT.exists() else []
    if args.fit_only:
        runs = recorded
    else:
        from lab import Lab

        reason = Lab.missing()
        if reason:
            raise SystemExit(f"no lab on this machine: {reason}")
        labs = [(rate, int(workers)) for rate, workers in (lab.split(":") for lab in args.labs)]
        # the labs measured now replace their recorded runs; the others' stay
        runs = [run for run in recorded if (run["rate"], run["workers"]) not in labs]
        for rate, workers in labs:
            runs += measure_lab(rate, workers)
            OUT.parent.mkdir(exist_ok=True)
            OUT.write_text(json.dumps({"command": "python benchmarks/lab_topologies.py", "runs": runs}, indent=1))
    points = per_step(runs)
    constants = fit(points)
    report(points, constants)
    OUT.parent.mkdir(exist_ok=True)
    out: dict[str, Any] = {"command": "python benchmarks/lab_topologies.py", "runs": runs, "points": points,
                           "constants": constants}
    OUT.write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
