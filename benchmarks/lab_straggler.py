"""The straggler effect by bandwidth: one worker host's link k times slower than the others, on the lab.

    python benchmarks/lab_straggler.py                     (root, after `make data`; about 10 minutes)
    python benchmarks/lab_straggler.py --slowdowns 1 10    (quicker)

benchmarks/straggler.py's workload and policies (W: MNIST-5k MLP, 2 workers, global batch 64,
5 epochs; sync, async, softsync c=2, allreduce), trained across hosts of the multi-host lab
(tests/e2e/lab.py): the driver's host and two one-core worker hosts, every link 1 Gbit/s both ways
except one worker host's, set to 1/k of that.  The slow worker computes as fast as the other; only
its pushes and pulls take longer (a straggler by bandwidth, where straggler.py's sleeps one by
compute).  A fresh lab per k; "time to target" as in straggler.py (the PS clock from the first
update to the first checkpoint at or above the target).  Writes benchmarks/results/lab_straggler.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
OUT = ROOT / "benchmarks" / "results" / "lab_straggler.json"
LINK_BITS = 1e9


def drive(args: argparse.Namespace) -> None:
    """On the lab's driver host: every policy once, one ``RESULT {json}`` line each."""
    from straggler import POLICIES, describe, time_to_target
    from throughput import EPOCHS, GLOBAL_BATCH, LR, MODEL, MOMENTUM
    from train import read_parquet_arrays

    import sparkdl

    spark = sparkdl.spark_session("sparkdl-lab-straggler", master=args.master, conf={
        "spark.driver.host": args.driver_host, "spark.driver.bindAddress": args.driver_host,
        "spark.ui.enabled": "false", "spark.executor.cores": "1", "spark.executor.memory": "1g",
        "spark.cores.max": "2"})
    spark.sparkContext.setLogLevel("ERROR")
    x, y = read_parquet_arrays(str(ROOT / "data" / "mnist" / "train.parquet"))
    x_test, y_test = read_parquet_arrays(str(ROOT / "data" / "mnist" / "test.parquet"))
    data = spark.sparkContext.parallelize(list(zip(x, y.tolist())), 2).cache()
    data.count()
    base = sparkdl.TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=GLOBAL_BATCH // 2, optimizer="sgd",
                               learning_rate=LR, momentum=MOMENTUM, timeout_s=300)
    for name, settings in POLICIES.items():
        row = time_to_target(data, MODEL, base.replace(**settings), x_test, y_test, args.target)
        print(describe(name, row, args.target), file=sys.stderr, flush=True)
        print("RESULT " + json.dumps({"policy": name, **row}), flush=True)
    spark.stop()


def measure(slowdown: int, target: float) -> list[dict]:
    """A lab with one worker host's link at 1/``slowdown`` of the others; every policy's row."""
    from lab import Lab

    with Lab(workers=2, rate="1gbit") as lab:
        lab.limit(lab.workers[1], str(LINK_BITS / slowdown))
        done = lab.run_driver([sys.executable, str(Path(__file__).resolve()), "--drive", "--master", lab.master_url,
                               "--driver-host", lab.driver.address, "--target", str(target)], timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the driver program failed:\n{done.stderr[-5000:]}")
        rows = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return [{"slowdown": slowdown, "slow_link_mbit": LINK_BITS / slowdown / 1e6, **row} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--slowdowns", type=int, nargs="+", default=[1, 3, 10])
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--driver-host", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(args)
        return
    rows = []
    for slowdown in args.slowdowns:
        for row in measure(slowdown, args.target):
            rows.append(row)
            reached = row["time_to_target_s"]
            print(f"k={slowdown:<3d} {row['policy']:13s} to {args.target:.2f}: "
                  f"{'   n/a' if reached is None else f'{reached:6.2f}'} s  fit {row['fit_s']:6.2f} s  "
                  f"final {row['final_accuracy']:.4f}  samples per worker {row['samples_per_worker']}", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "python benchmarks/lab_straggler.py --slowdowns "
                               + " ".join(map(str, args.slowdowns)) + f" --target {args.target}",
                               "link_bits": LINK_BITS, "target": args.target, "rows": rows}, indent=2) + "\n")
    print(f"-> {OUT}")


if __name__ == "__main__":
    main()
