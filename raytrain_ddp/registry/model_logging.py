"""A PyTorch model logged to MLflow (`log_pytorch_model`: an exported program, its signature and input
example), and that logging rehearsed ahead: the first `mlflow.pytorch.log_model` of a process imports
and exports for seconds; a thread does it once the ranks train, so registration after training does
not wait for it."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


class Rehearsal:
    """The one-time work of `log_pytorch_model` (`rehearse_model_logging`), done on a thread that the
    driver would otherwise wait for after training. `start` is called once the ranks train (the
    driver's first progress or report from rank 0), not as Ray Train starts: on a small machine the
    start is the cores' work, and where the driver joined a cluster of another session the lowest
    priority below does not yield to it (it delayed the first step). At the lowest CPU priority
    (`yield_the_cpu`): what the steps leave of the cores, within the driver's session.

    As a context manager it never outlives the run: torch.export keeps global state while it traces
    (one export at a time: `wait` before registering), and a thread still exporting as the command
    leaves Ray (a registration that failed at once) can end the process with status 1 while Ray's
    core worker shuts down ("The core worker has already been shutdown"), not the command's own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        def prepare() -> None:
            yield_the_cpu()
            try:
                rehearse_model_logging()
            except Exception as e:  # noqa: BLE001 - only a head start: registration will say what is wrong
                logger.debug("preparing model logging: %s", e)

        logger.debug("preparing model logging ahead of the registration")
        self._thread = threading.Thread(target=prepare, name="prepare-model-logging", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Rehearsal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


def rehearse_model_logging() -> None:
    """Log a one-layer model as `log_pytorch_model` does, to a temporary directory instead of the run,
    and resolve the tags MLflow gives a logged model: what is done once per process is then done. That
    is torch.export's compiler stack (seconds of imports on a small machine), MLflow's model flavors,
    its check of the pip requirements against the installed packages (it maps every installed
    package's modules: 0.6 s), and its context tags (git's commit through GitPython, whether this is
    a notebook through IPython)."""
    import mlflow.pytorch
    from mlflow.tracking.context.registry import resolve_tags

    example = np.zeros((2, 1), dtype=np.float32)  # 2 rows, as the registration's: a batch of 1 would specialize
    with tempfile.TemporaryDirectory() as directory:
        mlflow.pytorch.save_model(torch.nn.Linear(1, 1), f"{directory}/model", **model_files(example, example))
    resolve_tags()


def yield_the_cpu() -> None:
    """Run the calling thread under SCHED_IDLE (Linux, where a policy is per thread; elsewhere
    nothing changes): it runs only where a core would idle, and gives way at once to a thread that
    wakes, such as a training worker back from its all-reduce. Where Linux groups processes by session
    (autogroup, on in most distributions), it yields only within the driver's: to the Ray the driver
    started, not to a `ray start` cluster's workers on the same cores."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))


def log_pytorch_model(model: torch.nn.Module, input_example: np.ndarray, *, name: str) -> Any:
    """The default: an MLflow PyTorch model (an exported program) with a signature and input example."""
    import mlflow.pytorch

    with torch.no_grad():
        output = model(torch.from_numpy(input_example)).numpy()
    return mlflow.pytorch.log_model(model, name=name, **model_files(input_example, output))


def log_classifier(model: torch.nn.Module, input_example: np.ndarray, class_names: list[str], *, name: str) -> Any:
    """A classifier with `class_names`: the PyTorch model as `log_pytorch_model` saves it, inside an
    MLflow model that answers with each row's class and its scores by name (`named_outputs.py`,
    logged as the model's code). Its signature names the outputs and leaves the input to the model's
    own check (a short message for rows that are not a batch of the trained size: MLflow's schema
    refusal prints the whole input first); the PyTorch model inside keeps its signature and example."""
    import json
    from pathlib import Path

    import mlflow.pyfunc
    import mlflow.pytorch
    from mlflow.models import infer_signature
    from mlflow.models.signature import ModelSignature

    from raytrain_ddp.registry import named_outputs

    with torch.no_grad():
        output = model(torch.from_numpy(input_example)).numpy()
    files = model_files(input_example, output)
    answers = infer_signature(input_example, named_outputs.named(output, class_names)).outputs
    with tempfile.TemporaryDirectory() as directory:
        mlflow.pytorch.save_model(model, f"{directory}/pytorch", **files)
        described = Path(directory, "outputs.json")
        rows = {"row_shape": input_example.shape[1:], "dtype": str(input_example.dtype)}
        described.write_text(json.dumps({"class_names": class_names, **rows}))
        return mlflow.pyfunc.log_model(
            name=name,
            python_model=named_outputs.__file__,
            artifacts={"pytorch": f"{directory}/pytorch", "outputs": str(described)},
            signature=ModelSignature(inputs=None, outputs=answers),
            pip_requirements=files["pip_requirements"],
        )


def model_files(input_example: np.ndarray, output: np.ndarray) -> dict[str, Any]:
    """What a logged PyTorch model is saved with beside its weights: signature, input example, requirements."""
    from mlflow.models import infer_signature

    return {
        "signature": infer_signature(input_example, output),
        "input_example": input_example,
        "pip_requirements": [f"torch=={torch.__version__.split('+')[0]}"],
    }
