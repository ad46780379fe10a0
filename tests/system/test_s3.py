"""`run.storage_path: s3://bucket/prefix` against a real S3 server on loopback (moto's server mode),
found through the standard AWS environment variables: checkpoints, the lease, a failed run resumed by
a new driver, and the registered model's source all go through S3; MLflow's artifacts too (a real
`mlflow server` whose artifact store is the same S3). S3 that throttles, then fails, is a proxy in
front of it. Streamed datasets read their files from it too."""

from __future__ import annotations

import re
import shlex

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from services import FaultyS3, MLflowServer, S3Server, cli
from test_cli import TINY

from raytrain_ddp.data import stream


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


def test_storage_errors_are_retried_or_stop_the_run_which_resumes_and_registers_all_through_s3(
    s3, mlflow_server, tmp_path, record
):
    """FSDP2, so each of the 2 workers writes its own shards to S3 and the resume reads them from it. A
    proxy in front of S3 answers "503 SlowDown": to 5 writes of rank 0's shard of epoch 1 (more than
    the 3 attempts of pyarrow's own retry strategy: the service retries, and warns), then to every
    write of epoch 2's manifest, its last file (S3 down for good: the run stops, what landed of the
    checkpoint, every rank's shards, is removed, and the printed command resumes the run once S3 is
    back)."""
    storage = f"s3://{s3.bucket}/runs"
    proxy = FaultyS3(s3).start()
    proxy.fail("runs/on-s3/epoch_0001/shards/__0_0.distcp", 5)
    proxy.fail("runs/on-s3/epoch_0002/manifest.json", None)  # the rest of it lands, and must be removed
    command = [
        "train",
        TINY,
        "run.name=on-s3",
        f"run.storage_path={storage}",
        f"mlflow.tracking_uri={mlflow_server.url}",
        "train.epochs=3",
        "checkpoint.upload_retry_s=4",
        "scaling.strategy=fsdp",
    ]

    try:
        stopped = cli(*command, cwd=tmp_path, env=proxy.env)
        throttled = proxy.injected
        proxy.heal()
        assert stopped.returncode == 1, stopped.stderr[-3000:]
        warned = r"^warning: transient storage errors retried: epoch_0001: \d+ × .*SLOW_DOWN"
        assert re.search(warned, stopped.stdout, re.M), (throttled, stopped.stdout)
        assert f"checkpoint epoch_0002 could not be written to {storage}/on-s3/epoch_0002 (OSError: " in stopped.stderr
        assert "the storage kept failing for checkpoint.upload_retry_s=4 s" in stopped.stderr
        assert s3.keys("runs/on-s3/epoch_0001/manifest.json")  # the first epoch's checkpoint, on S3
        assert not s3.keys("runs/on-s3/epoch_0002")  # nothing of the second: what landed was removed
        assert not s3.keys("runs/on-s3/driver.json")  # the lease let go
        resume = re.search(r"^resume: (.+)$", stopped.stderr, re.M).group(1)

        resumed = cli(*shlex.split(resume)[1:], cwd=tmp_path, env=proxy.env)  # a new driver, the printed command
    finally:
        proxy.stop()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from epoch_0001 (epoch 1, step 4)" in resumed.stdout
    assert re.search(r"^  best checkpoint +s3://raytrain/runs/on-s3/epoch_000\d ", resumed.stdout, re.M)

    client = mlflow_server.client()
    [version] = client.search_model_versions("name = 'tiny'")
    from raytrain_ddp.registry.records import CHECKPOINT_TAG

    assert version.tags[CHECKPOINT_TAG].startswith(f"{storage}/on-s3/epoch_000")
    source = version.tags[CHECKPOINT_TAG].removeprefix(f"s3://{s3.bucket}/")
    assert s3.keys(f"{source}/manifest.json") and len(s3.keys(f"{source}/shards/__")) == 2  # a shard per rank
    assert [key for key in s3.keys("mlflow/") if key.endswith("/MLmodel")]  # MLflow's artifacts, in S3 too
    assert client.get_run(version.run_id).info.status == "FINISHED"
    record(
        "FSDP2 shards on S3 throttled (503 SlowDown) at checkpoint 1, then down at checkpoint 2 "
        "(upload_retry_s=4); the printed command run again",
        attempts="2 drivers",
        resumed="epoch_0001 (step 4), from S3",
        wasted="4 (epoch 2 again)",
        versions=1,
        checkpoints=len({key.split("/")[2] for key in s3.keys("runs/on-s3/epoch_")}),
        note=f"{throttled} writes refused; checkpoint 1 retried and kept",
    )


def test_parquet_shards_and_image_folders_stream_from_s3_as_from_a_local_directory(s3, tmp_path, monkeypatch):
    """A streamed dataset's `s3://` path, listed as the driver lists it and read as Ray Data's tasks
    read it (no training run: the reads are the functions they call): the same rows and labels as
    the same files in a local directory."""
    local = tmp_path / "data"
    for k, n in enumerate([5, 3, 4]):
        (local / "table").mkdir(parents=True, exist_ok=True)
        ids = np.arange(k * 10, k * 10 + n)
        table = pa.table({"id": ids, "x": list(np.stack([ids * 1.0, ids * 2.0], 1)), "note": ["unused"] * n})
        pq.write_table(table, local / "table" / f"part-{k}.parquet", row_group_size=2)
    for index, name in enumerate(["cat/a.png", "cat/b.png", "dog/c.png"]):
        (local / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((4, 4), index, dtype=np.uint8), mode="L").save(local / "images" / name)
    client = s3.client()
    for path in local.rglob("*.*"):
        client.upload_file(str(path), s3.bucket, f"streamed/{path.relative_to(local)}")
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)

    def both(make):
        return [make(root).listed(max_bad_files=0) for root in (str(local), f"s3://{s3.bucket}/streamed")]

    on_disk, on_s3 = both(lambda root: stream.Parquet(f"{root}/table", columns=("id", "x")))
    assert list(on_s3.manifest.rows) == list(on_disk.manifest.rows) == [5, 3, 4]  # from the footers
    assert all(uri.startswith(f"s3://{s3.bucket}/streamed/table/part-") for uri in on_s3.manifest.files)
    rows = on_s3.example(12, seed=0)
    assert sorted(rows) == ["id", "x"] and rows["id"].tolist() == on_disk.example(12, seed=0)["id"].tolist()
    np.testing.assert_array_equal(rows["x"], on_disk.example(12, seed=0)["x"])

    on_disk, on_s3 = both(lambda root: stream.ImageFolder(f"{root}/images", mode="L"))
    assert on_s3.manifest.classes == on_disk.manifest.classes == ("cat", "dog")
    images = on_s3.example(3, seed=0)
    assert images["label"].tolist() == [0, 0, 1] and [int(i.max()) for i in images["image"]] == [0, 1, 2]
