"""`run.storage_path: s3://bucket/prefix` against a real S3 server on loopback (moto's server mode),
found through the standard AWS environment variables: checkpoints, the lease, a failed run resumed by
a new driver, and the registered model's source all go through S3; MLflow's artifacts too (a real
`mlflow server` whose artifact store is the same S3)."""

from __future__ import annotations

import re
import shlex

import pytest
from services import MLflowServer, S3Server, cli
from test_cli import TINY


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mlflow_server(s3, tmp_path_factory):
    server = MLflowServer(
        tmp_path_factory.mktemp("mlflow-s3"), artifacts=f"s3://{s3.bucket}/mlflow", env=s3.env
    ).start()
    yield server
    server.stop()


def test_fit_kill_resume_register_all_through_s3(s3, mlflow_server, tmp_path, record):
    storage = f"s3://{s3.bucket}/runs"
    faults = tmp_path / "faults"
    faults.mkdir()
    command = [
        "train",
        TINY,
        "run.name=on-s3",
        f"run.storage_path={storage}",
        f"mlflow.tracking_uri={mlflow_server.url}",
        "train.epochs=3",
        "model.faults=['1:6:kill']",
        f"model.fault_log={faults}",  # rank 1 SIGKILLed mid-epoch 2
    ]

    killed = cli(*command, cwd=tmp_path, env=s3.env)
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert "rank 1: the worker process died" in killed.stderr
    assert s3.keys("runs/on-s3/epoch_0001/manifest.json")  # the first epoch's checkpoint, on S3
    assert not s3.keys("runs/on-s3/driver.json")  # the lease let go
    resume = re.search(r"^resume: (.+)$", killed.stderr, re.M).group(1)

    resumed = cli(*shlex.split(resume)[1:], cwd=tmp_path, env=s3.env)  # a new driver, the printed command
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from epoch_0001 (epoch 1, step 4)" in resumed.stdout
    assert re.search(r"^  best checkpoint +s3://raytrain/runs/on-s3/epoch_000\d ", resumed.stdout, re.M)

    client = mlflow_server.client()
    [version] = client.search_model_versions("name = 'tiny'")
    from raytrain_ddp.tracking import CHECKPOINT_TAG

    assert version.tags[CHECKPOINT_TAG].startswith(f"{storage}/on-s3/epoch_000")
    source = version.tags[CHECKPOINT_TAG].removeprefix(f"s3://{s3.bucket}/")
    assert s3.keys(f"{source}/manifest.json") and s3.keys(f"{source}/model.pt")
    assert [key for key in s3.keys("mlflow/") if key.endswith("/MLmodel")]  # MLflow's artifacts, in S3 too
    assert client.get_run(version.run_id).info.status == "FINISHED"
    record(
        "rank 1 SIGKILLed mid-epoch 2 (max_failures=0), storage on S3 (moto); the printed command run again",
        attempts="2 drivers",
        resumed="epoch_0001 (step 4), from S3",
        versions=1,
        checkpoints=len({key.split("/")[2] for key in s3.keys("runs/on-s3/epoch_")}),
    )
