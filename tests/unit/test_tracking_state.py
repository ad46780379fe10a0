"""Logging a model sets MLflow's global tracking URI for the call (MLflow's API needs it) and puts the
caller's back exactly: unset if it was unset. (Restoring MLflow's resolved default instead left
$MLFLOW_TRACKING_URI pointing at the first working directory's mlflow.db, so a later run() of the
same process, from another directory, read and wrote that store.)"""

from __future__ import annotations

import os

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from raytrain_ddp.registry import tracking


@pytest.mark.parametrize("caller", [None, "sqlite:///caller.db"], ids=["unset", "the-callers-own"])
def test_the_callers_tracking_uri_is_put_back_as_it_was(tmp_path, monkeypatch, caller):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(caller)
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    try:
        with tracking.active_run(uri, run_id):
            assert mlflow.get_tracking_uri() == uri and mlflow.active_run().info.run_id == run_id
        assert os.environ.get("MLFLOW_TRACKING_URI") == caller
        assert mlflow.active_run() is None
    finally:
        mlflow.set_tracking_uri(None)
