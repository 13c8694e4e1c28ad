"""examples/quickstart.ipynb executes headlessly without errors, on classic Spark and through Spark Connect."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from ..connect_port import one_connect_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("remote", [None, "local[2]"], ids=["classic", "connect"])
def test_quickstart_notebook_runs(tmp_path, monkeypatch, remote):
    import nbformat
    from nbclient import NotebookClient

    # the kernel inherits this environment; the notebook picks its mode from SPARK_REMOTE
    for name in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE"):
        monkeypatch.delenv(name, raising=False)
    if remote is not None:
        pytest.importorskip("grpc", reason="Spark Connect needs pip install 'sparkdl[connect]'")
        monkeypatch.setenv("SPARK_REMOTE", remote)
    notebook = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    with one_connect_server() if remote is not None else contextlib.nullcontext():
        NotebookClient(notebook, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.get("outputs", []))
    assert "test accuracy:" in outputs and "loaded model predicts the same: True" in outputs
    assert ("via Spark Connect" in outputs) == (remote is not None)
    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the history plot was not drawn"
