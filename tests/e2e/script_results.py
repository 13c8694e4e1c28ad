"""The ``RESULT {json}`` lines an e2e script prints and its test reads back: one JSON object per line.

Scripts that train several runs in one session (one cluster start for all) report each under its
name with :func:`report_each`; their tests read them with :func:`results_by_run`.
"""
from __future__ import annotations

import json
import subprocess
import traceback
from collections.abc import Callable

PREFIX = "RESULT "


def report_each(runs: dict[str, Callable[[], dict]]) -> None:
    """Run each in turn and print its result under ``"run"``, or the error it raised instead, so that one
    broken run does not hide the others' results."""
    for name, run in runs.items():
        try:
            result = run()
        except Exception:
            result = {"error": traceback.format_exc()}
        print(PREFIX + json.dumps({"run": name, **result}, default=float), flush=True)


def results(stdout: str) -> list[dict]:
    """Every RESULT line's object, in order."""
    return [json.loads(line[len(PREFIX):]) for line in stdout.splitlines() if line.startswith(PREFIX)]


def results_by_run(done: subprocess.CompletedProcess, names: list[str]) -> dict[str, dict]:
    """The result of each run named (or an error saying it printed none), from a script that exited cleanly."""
    assert done.returncode == 0, done.stderr[-5000:]
    by_run = {result["run"]: result for result in results(done.stdout)}
    return {name: by_run.get(name, {"error": f"no result: {done.stderr[-3000:]}"}) for name in names}


def succeeded(result: dict) -> dict:
    """``result``, once it is shown not to be an error (whose traceback is then the failure's message)."""
    assert "error" not in result, result["error"]
    return result
