"""examples/quickstart.ipynb runs top to bottom (tiny sizes in its parameters cell)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient", reason="nbclient (test extra) runs the notebook")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tags = [c.metadata.get("tags", []) for c in nb.cells]
    assert sum("parameters" in t for t in tags) == 1 and sum("install" in t for t in tags) == 1
    nb.cells = [c for c in nb.cells if "install" not in c.metadata.get("tags", [])]
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source += "\nWARM_STEPS, NUM_PROMPTS, GROUP = 3, 2, 2\nOUT = 'nb_run'\n"
    env_root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (env_root, os.environ.get("PYTHONPATH")) if p)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    def text(cell):
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    outputs = "\n".join(text(c) for c in nb.cells if c.cell_type == "code")
    assert "accuracy: dense" in outputs and "sparse (R-KV 32)" in outputs
    assert "rejection_rate" in outputs and "loss " in outputs
    assert "KV entries saved" in outputs
    plot = nb.cells[-2]
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)  # the KV plot
    assert (tmp_path / "nb_run" / "warm_start" / "config.json").is_file()
