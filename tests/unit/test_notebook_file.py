"""The committed quick-start notebook is clean: valid, no outputs, no paths of the machine it was
written on. (Running it is tests/system/test_notebook.py's.)"""

from __future__ import annotations

import tempfile
from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def test_the_committed_notebook_has_no_outputs_and_no_machine_paths():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"cell {cell.id}: clear its outputs"
    text = NOTEBOOK.read_text()
    for machine_path in (str(NOTEBOOK.parent.parent), str(Path.home()), tempfile.gettempdir()):
        assert machine_path not in text
