"""notebooks/quickstart.ipynb executes top to bottom without a cell error, in a kernel that imports hf_prefetch."""

import json
import os
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO_ROOT / "notebooks" / "quickstart.ipynb"
KERNEL_NAME = "hf-prefetch-test"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec on the fly: this interpreter (not whatever `python` is on PATH), with the repository importable."""
    spec_dir = tmp_path / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hf_prefetch tests",
        "language": "python",
        "env": {"PYTHONPATH": python_path},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("JUPYTER_PATH")])))
    return KERNEL_NAME


def test_quickstart_notebook_runs(kernel_name):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, kernel_name=kernel_name, timeout=300, resources={"metadata": {"path": str(REPO_ROOT)}}
    )
    client.execute()  # raises CellExecutionError on the first cell that fails

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    html = [output.data["text/html"] for output in outputs if "text/html" in output.get("data", {})]
    assert len(html) == 2 and all(table.startswith("<table>") for table in html)  # stats render as HTML tables
    assert "model.layers.7" in html[0] and "model.layers.6" in html[1]
