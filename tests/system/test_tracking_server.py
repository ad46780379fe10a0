"""A real MLflow tracking server (`mlflow server` on loopback, with MLflow's basic-auth app): training
over HTTP with credentials from MLflow's environment variables (and never anywhere else), wrong
credentials refused before training, a server that goes away after it, and `raytrain-ddp register`
finishing the registration later, once; the live metrics while a server is down, then back. (A
server that cannot be reached at all is tests/unit/test_tracking_refusals.py's.)"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from services import BIN, MLflowServer, cli, user_env, wait_until

import raytrain_ddp
from raytrain_ddp.checkpoint import format as checkpoint
from raytrain_ddp.registry import tracking

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MLflowServer(tmp_path_factory.mktemp("mlflow-server"), auth=True).start()
    yield server
    server.stop()


def test_server_gone_after_training_then_register_later_once(
    ray_session, server, workspace, monkeypatch, capsys, record
):
    """Credentials come from MLFLOW_TRACKING_USERNAME/PASSWORD; wrong ones are refused before
    training. The server is stopped the moment the last checkpoint lands: training still finishes,
    the checkpoints are safe, the driver exits 3 naming `raytrain-ddp register`; with the server
    back, registering twice (from Python, then with `raytrain-ddp register`, which answers from the
    registry) gives one version."""
    overrides = [*workspace.overrides("run.name=away", "train.epochs=3", f"mlflow.tracking_uri={server.url}")]

    wrong = cli(
        "train",
        TINY,
        *overrides,
        cwd=workspace.root,
        env={"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "not-the-password"},
    )
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert (
        "refused the credentials (HTTP 401); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in wrong.stderr
    )
    assert not (workspace.storage / "away").exists()

    run_path = workspace.storage / "away"
    # No retries of a call to the stopped server (the service bounds them at 3; a user's setting wins).
    env = user_env({**server.credentials, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    driver = subprocess.Popen(
        [str(BIN / "raytrain-ddp"), "train", TINY, *overrides],
        cwd=workspace.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for key, value in server.credentials.items():
        monkeypatch.setenv(key, value)
    client = server.client()

    def trained() -> bool:
        """The last checkpoint has landed, and the first two epochs' metrics are in MLflow (logged
        live, by the driver, on a thread that may lag a report behind training)."""
        if not (run_path / "epoch_0003" / "manifest.json").exists():
            return False
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "attributes.run_name='away'")
        return any(2 in [m.value for m in client.get_metric_history(r.info.run_id, "epoch")] for r in runs)

    wait_until(lambda: trained() or driver.poll() is not None, 600, "the last checkpoint", every_s=1)
    server.stop()
    out, err = driver.communicate(timeout=600)

    assert driver.returncode == 3, err[-3000:]
    assert "run away finished training (3 epochs), but its model was not registered" in err
    assert f"register it later: raytrain-ddp register {run_path}" in err
    kept = sorted(p for p in run_path.iterdir() if p.name.startswith("epoch_"))
    assert run_path / "epoch_0003" in kept
    for directory in kept:
        checkpoint.verify(directory)  # safe: whole, and what Ray committed

    server.start()  # the same store, back
    capsys.readouterr()
    registered = raytrain_ddp.register(str(run_path))  # what `raytrain-ddp register` runs, in this process
    first = capsys.readouterr()
    again = cli("register", str(run_path), cwd=workspace.root, env=server.credentials)
    assert registered.version == 1 and again.returncode == 0, again.stderr[-3000:]
    assert re.search(rf"{re.escape(str(run_path))}/epoch_000\d is tiny version 1", first.out)
    assert "is tiny version 1" in again.stdout and "already registered" in again.stdout  # from the registry alone

    [version] = client.search_model_versions("name = 'tiny'")
    training = client.get_run(version.run_id)
    assert training.info.status == "FINISHED" and training.info.run_name == "away"
    assert [m.value for m in client.get_metric_history(version.run_id, "epoch")][:2] == [1, 2]  # logged live
    assert "config.yaml" in {a.path for a in client.list_artifacts(version.run_id)}
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(server.url)  # models:/ URIs resolve through MLflow's global tracking URI
    try:
        model = mlflow.pyfunc.load_model("models:/tiny/1")
    finally:
        mlflow.set_tracking_uri(previous)
    assert model.predict(np.zeros((3, 4), dtype=np.float32)).shape == (3,)  # the registered model, served back

    secret = server.password
    assert all(secret not in value for value in training.data.params.values())
    assert secret not in (run_path / "epoch_0003" / "config.json").read_text()
    for output in (out, err, first.out, first.err, again.stdout, again.stderr, wrong.stdout, wrong.stderr):
        assert secret not in output
    record(
        "MLflow server stopped as the last checkpoint lands; `raytrain-ddp register` twice once it is back",
        attempts=1,
        checkpoints=f"{len(kept)} verified",
        versions=1,
        note="driver exit 3, then register exit 0 twice",
    )


def test_reports_while_the_server_is_down_ask_it_once_each_and_are_named_when_it_answers_or_at_the_end(
    tmp_path, monkeypatch, caplog
):
    """The driver's live metrics (`tracking.MetricsLog`): the first report the server does not take
    pays MLflow's retries; the next ones only ask whether it answers, without retries, so reports
    queued behind a server that is down do not hold the run's end for theirs. One warning names
    them, with their steps, when the server answers again (and logging goes on), or at the end."""
    monkeypatch.chdir(tmp_path)  # a new sqlite store's Default experiment goes under ./mlruns
    server = MLflowServer(tmp_path)  # down until step 4: its run made in its store directly
    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = store.create_run(store.create_experiment("down-and-back")).info.run_id
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the first failure at once (the driver: 3)
    caplog.set_level(logging.WARNING, logger=tracking.__name__)
    try:
        with tracking.MetricsLog(server.url, run_id) as log:
            for step in (1, 2, 3):
                log.add({"step": step, "loss": 1.0 / step}).result()
            server.start()
            log.add({"step": 4, "loss": 0.25}).result()
            server.stop()
            for step in (5, 6):
                log.add({"step": step, "loss": 0.2}).result()
    finally:
        server.stop()

    first, back, again, end = [r.getMessage() for r in caplog.records if r.name == tracking.__name__]
    assert first.startswith("MLflow: step 1 metrics not logged (")
    assert first.endswith(
        "; the next reports ask the server once each, without retries; see the checkpoint's metrics.json"
    )
    assert back == (
        "MLflow: the tracking server answers again; the metrics of 2 reports (steps 2-3) were not logged "
        "meanwhile (each checkpoint's metrics.json keeps them)"
    )
    assert again.startswith("MLflow: step 5 metrics not logged (")
    assert end.startswith(
        f"MLflow: the metrics of 1 report (step 6) were not logged: mlflow.tracking_uri: the MLflow tracking "
        f"server {server.url} is unreachable (connection refused)"
    )
    assert [m.step for m in store.get_metric_history(run_id, "loss")] == [4]
