"""Every notebook in notebooks/ executes end to end."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  # Runs in a fresh kernel: its own XLA_FLAGS, no state shared with this process.
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
