"""A Spark Connect client for the multi-host lab (tests/e2e/lab.py): fit digits through a Connect server.

Run on a lab host; fits ``connect_reference.SETTINGS`` on ``ROOT/train`` (Parquet) through the server
at ``--remote``, prints one ``RESULT {json}`` line (the model's summary and the fit's warnings) and saves its weights to
``--weights``.  The parameter server runs here, in the client, and the workers on the lab's worker
hosts reach it over their links.

    python tests/e2e/lab_connect_run.py --remote sc://10.200.77.1:15002 --data /tmp/digits --weights /tmp/w.pt
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sparkdl  # noqa: E402
from sparkdl import TorchEstimator  # noqa: E402
from tests.integration.connect_reference import DIGITS_MLP, SETTINGS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--remote", required=True, help="the Connect server, sc://host:port")
    parser.add_argument("--data", required=True, type=Path, help="the folder holding train/ as Parquet")
    parser.add_argument("--weights", required=True, help="where to save the final state_dict")
    args = parser.parse_args()
    spark = sparkdl.spark_session("sparkdl-lab-connect", remote=args.remote)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            model = TorchEstimator(model=DIGITS_MLP, **SETTINGS).fit(spark.read.parquet(str(args.data / "train")))
        torch.save(model.state_dict, args.weights)
        print("RESULT " + json.dumps({"summary": model.summary, "warnings": [str(w.message) for w in warned]},
                                     default=str), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
