"""`ray job submit` to a real 2-node Ray cluster on loopback (token authentication, dashboard on
127.0.0.1), as the README documents it: workers on both nodes, the driver and the controller on the
head without taking worker resources, checkpoints on storage both nodes share, the model registered
in a real MLflow tracking server."""

from __future__ import annotations

import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest
from services import REPO, LoopbackCluster, MLflowServer, cli, loopback_cluster

from raytrain_ddp.checkpoint import format as checkpoint
from raytrain_ddp.registry.records import CHECKPOINT_TAG


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MLflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()


def submit(cluster: LoopbackCluster, *train_args: str) -> tuple[str, str]:
    """The README's command, for tests/jobs/tiny.py; returns the submission id and the job's logs."""
    job_id = f"tiny-{secrets.token_hex(3)}"
    cluster.ray(
        "job",
        "submit",
        f"--submission-id={job_id}",
        "--working-dir",
        ".",
        "--",
        "raytrain-ddp",
        "train",
        "tests/jobs/tiny.py",
        *train_args,
        check=False,
        timeout=600,
    )
    return job_id, cluster.job_logs(job_id)


def listed(cluster: LoopbackCluster, *kinds: str) -> list[list[dict]]:
    """`ray list <kind> --detail` of each kind (jobs, nodes, actors, tasks)."""
    return [cluster.state(kind, detail=True) for kind in kinds]


def job(jobs: list[dict], job_id: str) -> dict:
    return next(job for job in jobs if job["submission_id"] == job_id)


def test_job_submit_trains_on_both_nodes_and_registers(cluster, mlflow_server, tmp_path):
    shared = tmp_path / "runs"  # one file system for both nodes of this machine
    job_id, logs = submit(
        cluster,
        "run.name=submitted",
        f"run.storage_path={shared}",
        f"mlflow.tracking_uri={mlflow_server.url}",
        "train.epochs=2",
        # 1.5 of each node's 2 CPUs: one worker per node, and half a CPU left on each for Ray Data.
        "scaling.resources_per_worker={CPU: 1.5}",
    )

    jobs, nodes, actors = listed(cluster, "jobs", "nodes", "actors")
    info = job(jobs, job_id)
    assert info["status"] == "SUCCEEDED", logs[-3000:]
    assert re.search(r"^submitted finished: 2 epochs in ", logs, re.M), logs[-3000:]
    assert re.search(r"^  registered model +tiny  version 1$", logs, re.M)
    assert re.search(r"^epoch +2/2 +train_loss", logs, re.M)  # live progress reaches the job's log

    head = next(node["node_id"] for node in nodes if node["is_head_node"])
    workers = {a["node_id"] for a in actors if a["class_name"] == "RayTrainWorker" and a["job_id"] == info["job_id"]}
    controllers = {
        a["node_id"] for a in actors if a["class_name"] == "TrainController" and a["job_id"] == info["job_id"]
    }
    assert workers == {node["node_id"] for node in nodes}  # one worker on each node
    assert info["driver_node_id"] == head and controllers == {head}
    assert not info.get("entrypoint_num_cpus") and not info.get("entrypoint_resources")  # off worker resources

    best = shared / "submitted" / "epoch_0002"
    checkpoint.verify(best)
    version = mlflow_server.client().get_model_version("tiny", "1")
    assert version.tags[CHECKPOINT_TAG] == str(best)
    history = mlflow_server.client().get_metric_history(version.run_id, "val_mse")
    assert len(history) == 2


def test_a_streamed_dataset_is_read_on_the_data_node_while_the_workers_train_on_the_other(
    cluster, mlflow_server, tmp_path
):
    """Parquet shards streamed (tiny's `source: parquet`), the workers held to the node labelled
    role=train (the head) and the reading tasks to the one labelled role=data: where each ran, from
    Ray's own record of the job's actors and tasks."""
    job_id, logs = submit(
        cluster,
        "run.name=placed",
        f"run.storage_path={tmp_path / 'runs'}",
        f"mlflow.tracking_uri={mlflow_server.url}",
        "dataset.source=parquet",
        f"dataset.path={tmp_path / 'table'}",
        "dataset.rows=512",
        "scaling.resources_per_worker={CPU: 0.5}",
        "scaling.label_selector={role: train}",
        "data.label_selector={role: data}",
        "mlflow.register=never",  # where the data is read, not the model: the submit test registers
    )

    jobs, nodes, actors, tasks = listed(cluster, "jobs", "nodes", "actors", "tasks")
    info = job(jobs, job_id)
    assert info["status"] == "SUCCEEDED", logs[-3000:]
    nodes = {node["labels"].get("role"): node["node_id"] for node in nodes}
    workers = [a["node_id"] for a in actors if a["class_name"] == "RayTrainWorker" and a["job_id"] == info["job_id"]]
    reads = [t["node_id"] for t in tasks if "read_pieces" in t["name"] and t["job_id"] == info["job_id"]]
    assert workers == [nodes["train"]] * 2
    # Each worker reads 2 epochs of training rows and 2 validations: a task or more each time.
    assert len(reads) >= 8 and set(reads) == {nodes["data"]}, reads


def test_storage_only_one_node_sees_and_defaults_inside_the_jobs_temporary_directory_are_refused(cluster, tmp_path):
    """Two jobs submitted at once (each is refused in seconds, after a submission's fixed ~15 s):
    - `run.storage_path` a directory that only the head node sees: refused once Ray is joined, before
      training, by the probe that writes from every node;
    - the defaults: `./runs` and `sqlite:///mlflow.db` resolve inside the copy of the working directory
      that Ray deletes after the job: refused before Ray is even joined."""
    if not cluster.node_local_isolated:
        message = "needs a mount namespace (unshare, as root) to give one node a directory the other cannot see"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with ThreadPoolExecutor(2) as pool:
        node_local = pool.submit(
            submit,
            cluster,
            f"run.storage_path={cluster.node_local}",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "scaling.resources_per_worker={CPU: 1.5}",
        )
        defaults = pool.submit(submit, cluster)
    (local_id, local_logs), (defaults_id, defaults_logs) = node_local.result(), defaults.result()
    [jobs] = listed(cluster, "jobs")

    assert job(jobs, local_id)["status"] == "FAILED"
    assert f"run.storage_path: {cluster.node_local} is not shared by the cluster's nodes" in local_logs
    assert "Use a path every node mounts (NFS, EFS) or an s3:// URI" in local_logs
    assert "epoch   1/" not in local_logs  # nothing trained
    assert list(cluster.node_local.iterdir()) == []  # the probe cleaned up after itself, here at least

    assert job(jobs, defaults_id)["status"] == "FAILED"
    assert re.search(
        r"run.storage_path: \S+/runtime_resources/\S+/runs is in the job's temporary working directory",
        defaults_logs,
    )
    assert "set mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to a tracking server" in defaults_logs


def test_a_driver_that_sends_no_token_is_refused_saying_what_to_set(cluster, tmp_path):
    """The cluster has token auth: a driver on the head with RAY_AUTH_MODE=disabled reaches its GCS and
    is refused. The error names the setting and where the token goes, not a wrong address."""
    env = cluster.env | {"RAY_ADDRESS": f"127.0.0.1:{cluster.gcs_port}", "RAY_AUTH_MODE": "disabled"}
    storage = (f"run.storage_path={tmp_path / 'runs'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}")
    refused = cli("train", str(REPO / "tests" / "jobs" / "tiny.py"), *storage, cwd=tmp_path, env=env, timeout=120)

    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    said = refused.stderr
    assert f"RAY_ADDRESS=127.0.0.1:{cluster.gcs_port}: the Ray cluster there could not be joined" in said, said
    assert "RAY_AUTH_MODE=disabled sends no token, which a cluster with token auth (Ray's default) refuses" in said
    assert "set RAY_AUTH_MODE=token, or unset it, with the cluster's token in RAY_AUTH_TOKEN" in said
    assert not (tmp_path / "runs").exists()
