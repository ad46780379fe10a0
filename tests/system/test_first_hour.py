"""A newcomer's first hour, as the README tells it: the README's own job, written out away from the
project and run by path on a CSV, registers a model that takes the rows the user has (raw
measurements) and, served over HTTP by `mlflow models serve`, gets the accuracy the run reported. A
bug only the workers hit stops the run naming the file that holds the workers' full tracebacks.
(What pre-flight refuses on two rows: tests/unit/test_preflight.py.)"""

from __future__ import annotations

import io
import json
import urllib.request

import numpy as np
import pytest
from rich.console import Console
from services import BIN, free_port, serve, stop_group, user_env
from sklearn.datasets import load_wine

from raytrain_ddp import load_config
from raytrain_ddp.config import recipe as recipes


def test_the_readme_job_serves_raw_rows_over_http_with_the_reported_accuracy(ray_session, workspace, readme_job):
    from raytrain_ddp import run

    config = load_config(
        str(readme_job),
        overrides=workspace.overrides(f"dataset.path={readme_job.parent / 'wine.csv'}", "train.epochs=10"),
    )
    summary = run(config)
    val = recipes.load(str(readme_job)).make_datasets(config)["val"].take_batch(100, batch_format="numpy")
    raw, _ = load_wine(return_X_y=True)
    assert all((np.isclose(raw, row, rtol=1e-6).all(axis=1)).any() for row in val["x"])  # the CSV's raw rows

    port = free_port()
    env = user_env({"MLFLOW_TRACKING_URI": summary.tracking_uri, "PATH": f"{BIN}:{user_env()['PATH']}"})
    command = [BIN / "mlflow", "models", "serve", "-m", summary.model.uri, "--env-manager", "local", "-p", str(port)]
    server = serve(command, workspace.root / "serve.log", f"http://127.0.0.1:{port}/ping", env)
    try:
        served = _predict(port, val["x"])
        everything = _predict(port, raw.astype(np.float32))
    finally:
        stop_group(server)
    accuracy = float((served.argmax(axis=1) == val["y"]).mean())
    assert len(val["y"]) == 45 and accuracy == pytest.approx(summary.metrics["val_accuracy"], abs=1e-9)
    assert accuracy >= 0.9
    assert (everything.argmax(axis=1) == load_wine().target).mean() >= 0.9  # all 178 raw rows


def _predict(port: int, rows: np.ndarray) -> np.ndarray:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=json.dumps({"inputs": rows.tolist()}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return np.array(json.loads(response.read())["predictions"])


def test_a_bug_only_the_workers_hit_names_the_file_with_their_full_tracebacks(ray_session, workspace, readme_job):
    from raytrain_ddp import RunFailed, run

    recipe = readme_job.read_text()
    bug = "    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:\n"
    bug += "        raise KeyError('weights')\n"
    recipe = recipe.replace(
        "def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:\n",
        "def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:\n" + bug,
    )
    readme_job.write_text(recipe)
    config = load_config(
        str(readme_job), overrides=workspace.overrides(f"dataset.path={readme_job.parent / 'wine.csv'}", "run.name=bug")
    )
    shown = io.StringIO()
    with pytest.raises(RunFailed) as failed:
        run(config, verbose=True, console=Console(file=shown, width=200))
    message = str(failed.value)
    assert "rank 1: KeyError: 'weights'" in message
    [log] = (workspace.storage / "bug" / "errors").glob("*.log")
    assert f"the workers' full tracebacks: {log}" in message
    traceback = log.read_text()
    assert "Traceback" in traceback and 'wine.py", line' in traceback and "raise KeyError('weights')" in traceback
    assert "raise KeyError('weights')" in shown.getvalue()  # --verbose prints them too
