"""notebooks/quickstart.ipynb runs top to bottom, as a user runs it, in a fresh kernel of this venv.

    .venv/bin/pytest tests/system/test_notebook.py

The kernel starts in a temporary directory with no Ray address and no MLflow settings in its
environment, so it starts its own embedded Ray (beside the tests' shared one, if that is up) and
writes runs/ and mlflow.db there, as the notebook does next to itself on a laptop.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 480  # the training cell: about 2 minutes on 2 idle cores


def test_the_quickstart_notebook_trains_plots_registers_and_predicts(tmp_path, tmp_path_factory):
    from mlflow.tracking import MlflowClient
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Not in the notebook: which interpreter ran it, and whether its last cell stopped Ray.
    notebook.cells.append(
        nbformat.v4.new_code_cell("import sys\nprint(sys.executable, ray.is_initialized())", id="probe")
    )
    client = NotebookClient(
        notebook,
        km=_kernel_of_this_interpreter(tmp_path_factory.mktemp("kernelspec")),
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    ray_tmp = tempfile.mkdtemp(prefix="ray-nb-")  # short: Ray's socket paths must fit in 107 bytes
    clean = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("MLFLOW_")}
    started = time.monotonic()
    try:
        # A failing cell raises CellExecutionError, with its traceback. cleanup_kc: shut the kernel (and
        # with it any Ray it started) down even so; nbclient leaves a kernel it did not create running.
        client.execute(cleanup_kc=True, env={**clean, "RAY_TMPDIR": ray_tmp})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"notebook ran in {time.monotonic() - started:.0f} s")
    cells = {cell.id: cell for cell in notebook.cells}

    assert _stdout(cells["probe"]) == f"{sys.executable} False\n"
    assert _has_image(cells["plot"])

    mlflow = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the notebook's ./mlflow.db
    [version] = mlflow.search_model_versions("name = 'digits-resnet18'")
    assert version.status == "READY"
    assert version.tags["raytrain_ddp.checkpoint"].startswith(str(tmp_path / "runs"))
    epochs = mlflow.get_metric_history(version.run_id, "epoch")
    assert [m.value for m in epochs] == [1.0, 2.0]

    predicted = re.fullmatch(
        r"(\d+) validation rows: accuracy ([\d.]+) \(training reported ([\d.]+)\)\n", _stdout(cells["predict"])
    )
    assert predicted, _stdout(cells["predict"])
    rows, accuracy, reported = int(predicted[1]), float(predicted[2]), float(predicted[3])
    assert rows == 360 and accuracy >= 0.9
    assert abs(accuracy - reported) <= 1 / rows  # the registered model is the checkpoint training evaluated
    assert _has_image(cells["predict"])


def _kernel_of_this_interpreter(prefix: Path):
    """A kernel manager whose kernelspec runs sys.executable: not whichever `python3` kernel Jupyter's
    search path finds first (a user-wide one, say)."""
    from ipykernel.kernelspec import install
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec = Path(install(kernel_name="raytrain-ddp-test", prefix=str(prefix)))
    return AsyncKernelManager(
        kernel_name=spec.name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)])
    )


def _stdout(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _has_image(cell) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.outputs)
