"""notebooks/quickstart.ipynb executes top to bottom without a cell error, in a kernel that imports hf_prefetch.

The notebook asserts itself that its tokens equal those of the unmodified model; this test checks that it ran and
showed what it says: the plan, two statistics tables and two plots."""

import json
import os
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")  # the notebook plots the statistics

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
    # The budget's plan streams layers 0, 2, 4, 6 and 7; the second configuration 2, 3, 6 and 7.
    assert "model.layers.4" in html[0] and "model.layers.4" not in html[1] and "model.layers.3" in html[1]
    text = "".join(output.get("text", "") for output in outputs if output.output_type == "stream")
    assert "to fit the budget" in text and "transfer per forward" in text  # the plan, printed before the load
    assert "page-locked: 0 bytes" in text  # remove_offload unpinned everything
    images = [output for output in outputs if "image/png" in output.get("data", {})]
    assert len(images) == 2  # first.plot() and the two configurations side by side
