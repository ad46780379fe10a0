"""A node of a real 2-node Ray cluster on loopback dies (every process of it SIGKILLed, as a machine
dies), and a cluster shared by two runs: what survives and what the user is told. Drivers are the
command line joining the cluster by its GCS address, on the head, as `raytrain-ddp train` run there.

- a node dies mid-run and no node can take its worker: the run says it waits for resources, what for
  and what the cluster has; a node joins, and the run resumes by itself from its latest checkpoint
  and ends with the weights of a run never interrupted;
- a second run whose workers do not fit next to the first's: it says which run holds the resources,
  and gives up after run.resources_wait_s with the command that resumes it; with
  run.resources_wait_s=0 it is refused at once.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from services import BIN, LoopbackCluster, cli, loopback_cluster

from raytrain_ddp import checkpoint as ckpt

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")
# One worker on each 2-CPU node (1.5 CPU each, half a CPU left to Ray Data), 128 steps an epoch.
ONE_PER_NODE = ("scaling.num_workers=2", "scaling.resources_per_worker={CPU: 1.5}", "dataset.rows=2048")


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster() as cluster:
        yield cluster


def _driver_env(cluster: LoopbackCluster) -> dict[str, str]:
    """A driver on the head: the cluster's token, and its GCS address to join."""
    return cluster.env | {"RAY_ADDRESS": f"127.0.0.1:{cluster.gcs_port}"}


def _train(cluster: LoopbackCluster, workdir: Path, *overrides: str, popen: bool = False):
    """`raytrain-ddp train` of tiny, one worker a node, each run with an MLflow store of its own."""
    name = next(o.split("=", 1)[1] for o in overrides if o.startswith("run.name="))
    storage = (f"run.storage_path={workdir / 'runs'}", f"mlflow.tracking_uri=sqlite:///{workdir / name}.db")
    command = [str(BIN / "raytrain-ddp"), "train", TINY, *ONE_PER_NODE, *storage, *overrides]
    if popen:
        return subprocess.Popen(
            command, cwd=workdir, env=_driver_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return cli(*command[1:], cwd=workdir, env=_driver_env(cluster))


def _read_until(process: subprocess.Popen, pattern: str, seen: list[str], timeout_s: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if found := re.search(pattern, line):
            return found
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)[-4000:]}")


def test_a_node_lost_mid_run_waits_for_a_node_says_so_and_resumes_on_the_new_one(cluster, tmp_path, record):
    straight = _train(cluster, tmp_path, "train.epochs=8", "run.name=straight")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]

    seen: list[str] = []
    driver = _train(
        cluster,
        tmp_path,
        "train.epochs=8",
        "run.name=lost",
        "run.max_failures=1",
        "run.resources_wait_s=300",
        popen=True,
    )
    _read_until(driver, r"^epoch +2/8 ", seen)
    [doomed] = [node["node_id"] for node in cluster.nodes() if not node["is_head_node"]]
    killed_at = time.monotonic()
    assert cluster.kill_node("worker")
    failed = _read_until(driver, r"^attempt 1 failed: (.*)$", seen)
    detected_s = time.monotonic() - killed_at
    waiting = _read_until(driver, r"^waiting for resources .*$", seen)
    cluster.add_node("spare")
    _read_until(driver, r"^resources found after \d+ s", seen)
    resumed = _read_until(driver, r"^epoch +(\d)/8 ", seen)
    resumed_s = time.monotonic() - killed_at
    out = "".join(seen) + driver.communicate(timeout=300)[0]

    assert driver.returncode == 0, out[-4000:]
    assert re.match(rf"node \S+ \(id {doomed[:8]}\) was lost, with rank 1 \(rank 0: ", failed.group(1)), failed.group(0)
    restarted = re.search(r"restarted from (epoch_000\d)", failed.group(1)).group(1)
    assert "2 workers × {CPU: 1.5}; the cluster has 1 node(s) alive, CPU 2 free of 2" in waiting.group(0)
    # Training goes on from the checkpoint (reported again first, if Ray had not recorded it), not epoch 1.
    assert int(resumed.group(1)) >= int(restarted[-4:])
    final = ckpt.open_verified(tmp_path / "runs" / "lost" / "epoch_0008").model_state()
    expected = ckpt.open_verified(tmp_path / "runs" / "straight" / "epoch_0008").model_state()
    torch.testing.assert_close(final, expected, rtol=0, atol=0)
    [version] = MlflowClient(f"sqlite:///{tmp_path / 'lost'}.db").search_model_versions("name = 'tiny'")
    record(
        "a worker node SIGKILLed (every process) mid-run; no node free until a new one joins",
        attempts=2,
        resumed=restarted,
        wasted="< 1 epoch",
        checkpoints=len(list((tmp_path / "runs" / "lost").glob("epoch_*"))),
        versions=1,
        note=f"failure shown {detected_s:.0f} s after the kill; training again {resumed_s:.0f} s after it",
    )


def test_a_run_that_does_not_fit_next_to_another_names_it_and_gives_up_or_is_refused(cluster, tmp_path, record):
    seen: list[str] = []
    holder = _train(cluster, tmp_path, "train.epochs=200", "run.name=holder", popen=True)
    try:
        _read_until(holder, r"^epoch +1/200 ", seen)
        with ThreadPoolExecutor(2) as pool:
            waits = pool.submit(_train, cluster, tmp_path, "run.name=second", "run.resources_wait_s=8")
            started = time.monotonic()
            refused = pool.submit(_train, cluster, tmp_path, "run.name=third", "run.resources_wait_s=0").result()
            refused_s = time.monotonic() - started
            waited = waits.result()
    finally:
        holder.send_signal(signal.SIGINT)
        holder.communicate(timeout=120)

    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "run.resources_wait_s=0 and the workers do not fit now: 2 workers × {CPU: 1.5}" in refused.stderr
    assert re.search(r"held by run holder \(job \w+, 2 workers × \{CPU: 1\.5\}\)", refused.stderr), refused.stderr
    assert not (tmp_path / "runs" / "third").exists()

    assert waited.returncode == 1, waited.stdout[-3000:] + waited.stderr[-3000:]
    said = waited.stdout + waited.stderr
    assert "the workers' resources did not come within 8 s (run.resources_wait_s)" in said
    assert re.search(r"held by run holder \(job \w+, 2 workers × \{CPU: 1\.5\}\)", said), said[-3000:]
    assert re.search(r"^resume: raytrain-ddp train .* run\.name=second", waited.stderr, re.M), waited.stderr[-3000:]
    record(
        "a second run's workers do not fit next to a running one",
        attempts=1,
        checkpoints=0,
        versions=0,
        note=f"named the run holding them; gave up after run.resources_wait_s=8; with 0 refused in {refused_s:.0f} s",
    )
