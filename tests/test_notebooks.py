"""The notebooks run top to bottom (small settings are their defaults), and are committed lean."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds per cell; the slowest cell (SchNet training) takes about a minute here
MAX_NOTEBOOK_BYTES = 100_000  # committed with outputs cleared: text only


def test_the_four_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["DFT-dataset-generation.ipynb", "ERI-visualisation-JK.ipynb",
                                           "SchNet-baseline.ipynb", "nanoDFT-demo.ipynb"]  # fmt: skip


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_and_small(path):
    """No embedded images or stale outputs in the repository: outputs are made by running them."""
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path):
    """Every cell runs without error; a failing cell raises CellExecutionError and fails the test."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    client.execute()
    images = sum("image/png" in o.get("data", {}) for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 1  # the pictures really rendered
