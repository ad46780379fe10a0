"""A real 2-node Ray cluster on loopback loses a node (every process of it SIGKILLed, as a machine
dies), has one preempted, and is shared by two runs: what survives and what the user is told. Drivers
are the command line joining the cluster by its GCS address, on the head, as `raytrain-ddp train` run
there.

- the workers fill the cluster, one on each node: each is a process the driver had started ahead;
- a node dies mid-run and no node can take its worker: the failure names the node, the run says it
  waits for resources, what for and what the cluster has; a node joins, and the run resumes by itself
  from its latest checkpoint and ends with the weights of a run never interrupted;
- a node is drained for a preemption (Ray's API, as a spot reclaim): a checkpoint at once, and the
  restart from it at the deadline is not charged to run.max_failures;
- a second run whose workers do not fit next to the first's: it says which run holds the resources,
  and gives up after run.resources_wait_s with the command that resumes it; with
  run.resources_wait_s=0 it is refused at once. Then the first run loses its node with no restart
  left: its final error names the node.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from services import BIN, LoopbackCluster, cli, loopback_cluster, tiny_passes

from raytrain_ddp.checkpoint import format as ckpt

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")
# One worker on each 2-CPU node (1.5 CPU each, half a CPU left to Ray Data), 128 steps an epoch.
ONE_PER_NODE = ("scaling.num_workers=2", "scaling.resources_per_worker={CPU: 1.5}", "dataset.rows=2048")
# The lost node's run and the run it compares with: its node is killed once epoch 2 is shown, 4 before the end.
EPOCHS = 6
# The elastic run's train.epochs: only an upper bound, never reached (the test stops it with SIGTERM once
# all is shown), there for a fast machine.
ELASTIC_EPOCHS = 1000
# Runs the tests watch, or stop, rather than train out (the holder, the elastic run): each training pass
# waits this long (tests/jobs/tiny.py), 1.3-2.6 s an epoch, so that while the test waits on the cluster
# the cores are free for the other test file rather than training epochs nobody reads.
WATCHED_STEP_S = 0.01


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster() as cluster:
        yield cluster


def _driver_env(cluster: LoopbackCluster) -> dict[str, str]:
    """A driver on the head: the cluster's token, and its GCS address to join."""
    return cluster.env | {"RAY_ADDRESS": f"127.0.0.1:{cluster.gcs_port}"}


def _train(cluster: LoopbackCluster, workdir: Path, *overrides: str, popen: bool = False, env: dict | None = None):
    """`raytrain-ddp train` of tiny, one worker a node, each run with an MLflow store of its own."""
    name = next(o.split("=", 1)[1] for o in overrides if o.startswith("run.name="))
    storage = (f"run.storage_path={workdir / 'runs'}", f"mlflow.tracking_uri=sqlite:///{workdir / name}.db")
    command = [str(BIN / "raytrain-ddp"), "train", TINY, *ONE_PER_NODE, *storage, *overrides]
    if popen:
        return subprocess.Popen(
            command,
            cwd=workdir,
            env=_driver_env(cluster) | (env or {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
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


@pytest.fixture(scope="module")
def straight_run(cluster, tmp_path_factory) -> Path:
    """The run the interrupted ones are compared with: its directory."""
    workdir = tmp_path_factory.mktemp("straight")
    done = _train(cluster, workdir, f"train.epochs={EPOCHS}", "run.name=straight", "mlflow.register=never")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return workdir / "runs" / "straight"


@pytest.fixture(scope="module")
def straight(straight_run) -> dict[str, torch.Tensor]:
    """Its final weights."""
    return ckpt.open_verified(straight_run / f"epoch_{EPOCHS:04d}").model_state()


def test_the_workers_on_both_nodes_are_the_processes_the_driver_started_ahead(cluster, straight_run):
    """One worker on each node fills the cluster: Ray has no choice of their nodes, and the driver
    asked each node's raylet for its worker's process as it joined, while the command still imported
    torch and Ray Train (prestart.py). Ray Train's workers are those: launched before the command's
    imports ended and before the controller's process, where processes asked for once the driver had
    loaded, or started by Ray as the controller asked, would be launched after (Ray's own record)."""
    launched = {(w["node_id"], w["pid"]): w["worker_launch_time_ms"] for w in cluster.state("workers", detail=True)}
    actors = cluster.state("actors", detail=True)
    [controller] = [a for a in actors if a["class_name"] == "TrainController"]  # straight's: the first run here
    workers = [a for a in actors if a["class_name"] == "RayTrainWorker"]
    assert {w["node_id"] for w in workers} == {n["node_id"] for n in cluster.nodes()}, workers  # one on each
    imports_ms = dict(json.loads((straight_run / "timeline.json").read_text())["marks"])["imports"] * 1e3
    controller_launched = launched[controller["node_id"], controller["pid"]]
    assert all(launched[w["node_id"], w["pid"]] < min(imports_ms, controller_launched) for w in workers), (
        imports_ms,
        controller,
        workers,
        launched,
    )


def test_a_node_lost_mid_run_waits_for_a_node_says_so_and_resumes_on_the_new_one(cluster, straight, tmp_path, record):
    seen: list[str] = []
    driver = _train(
        cluster,
        tmp_path,
        f"train.epochs={EPOCHS}",
        "run.name=lost",
        "run.max_failures=1",
        "run.resources_wait_s=300",
        popen=True,
    )
    _read_until(driver, rf"^epoch +2/{EPOCHS} ", seen)
    [(name, doomed)] = cluster.workers.items()
    killed_at = time.monotonic()
    assert cluster.kill_node(name)
    failed = _read_until(driver, r"^attempt 1 failed: (.*)$", seen)
    detected_s = time.monotonic() - killed_at
    waiting = _read_until(driver, r"^waiting for resources .*$", seen)
    cluster.add_node("spare")
    _read_until(driver, r"^resources found after \d+ s", seen)
    resumed = _read_until(driver, rf"^epoch +(\d)/{EPOCHS} ", seen)
    resumed_s = time.monotonic() - killed_at
    out = "".join(seen) + driver.communicate(timeout=300)[0]

    assert driver.returncode == 0, out[-4000:]
    lost = rf"node \S+ \(id {doomed[:8]}\) was lost, with rank [01] \(rank [01]: "  # the other rank's error after
    assert re.match(lost, failed.group(1)), failed.group(0)
    restarted = re.search(r"restarted from (epoch_000\d)", failed.group(1)).group(1)
    assert "2 workers × {CPU: 1.5}; the cluster has 1 node(s) alive, CPU 2 free of 2" in waiting.group(0)
    # Training goes on from the checkpoint (reported again first, if Ray had not recorded it), not epoch 1.
    assert int(resumed.group(1)) >= int(restarted[-4:])
    final = ckpt.open_verified(tmp_path / "runs" / "lost" / f"epoch_{EPOCHS:04d}").model_state()
    torch.testing.assert_close(final, straight, rtol=0, atol=0)
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


def test_a_preempted_node_gets_a_checkpoint_in_time_and_its_restart_costs_no_failure(cluster, tmp_path, record):
    """The worker node is drained for a preemption through Ray's API (as a cloud's spot reclaim is),
    with a 6 s deadline, in an epoch of ~8 s: the workers take a checkpoint at once, mid-epoch, and
    wait; at the deadline Ray Train restarts them, the node goes, and the run resumes from that
    checkpoint on a new node, the restart not charged to run.max_failures=0."""
    seen: list[str] = []
    driver = _train(
        cluster,
        tmp_path,
        "model.step_s=0.06",  # an epoch of 128 steps takes ~8 s, the cores mostly free meanwhile
        "train.epochs=2",  # the drain in epoch 2, the last: the workers wait in it for the restart
        "run.name=preempted",
        "run.max_failures=0",
        "mlflow.register=never",  # registration after a restart: the lost-node test's
        "checkpoint.preemption_check_steps=4",
        "checkpoint.num_to_keep=null",
        popen=True,
        env={"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"},  # Ray Train's watcher asks every 5 s by default
    )
    _read_until(driver, r"^epoch +1/2 ", seen)
    [(name, doomed)] = cluster.workers.items()
    drained_at = time.monotonic()
    cluster.ray(
        "drain-node",
        f"--address=127.0.0.1:{cluster.gcs_port}",
        f"--node-id={doomed}",
        "--reason=DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message=spot instance reclaimed",
        "--deadline-remaining-seconds=6",
    )
    in_time = _read_until(driver, r"^ +step +(\d+) \(epoch 1\.\d+\)", seen)  # a checkpoint mid-epoch 2
    taken_s = time.monotonic() - drained_at
    # Ray Train restarts the workers at the deadline; the cloud then takes the node away.
    ended = _read_until(driver, r"^attempt 1 ended: (.*)$", seen)
    cluster.kill_node(name)
    cluster.add_node(f"{name}-again")
    out = "".join(seen) + driver.communicate(timeout=300)[0]

    assert driver.returncode == 0, out[-4000:]  # with run.max_failures=0
    assert re.search(
        rf"^preempting: node {doomed[:8]} \(rank [01]\) preempted \(drained, reclaimed in \d s\)", out, re.M
    )
    assert "attempt 1 failed" not in out
    jit = f"epoch_0002-step_{int(in_time.group(1)):07d}"
    assert ended.group(1).endswith(f"— restarted from {jit} (not counted in run.max_failures)"), ended.group(0)
    run_dir = tmp_path / "runs" / "preempted"
    assert sorted(p.name for p in run_dir.glob("epoch_*")) == ["epoch_0001", "epoch_0002", jit]
    for directory in run_dir.glob("epoch_*"):
        ckpt.verify(directory)
    record(
        "the worker node drained for a preemption (6 s deadline), then taken away; run.max_failures=0",
        attempts=2,
        resumed=f"{jit} (reported {taken_s:.0f} s after the drain)",
        wasted="the steps since it",
        checkpoints="3, all verified",
        versions="0 (mlflow.register=never)",
        note="restarted at the deadline; not counted as a failure",
    )


def test_a_run_that_does_not_fit_next_to_another_names_it_and_gives_up_or_is_refused(cluster, tmp_path, record):
    seen: list[str] = []
    holder = _train(
        cluster, tmp_path, "train.epochs=200", "run.name=holder", f"model.step_s={WATCHED_STEP_S}", popen=True
    )
    try:
        _read_until(holder, r"^epoch +1/200 ", seen)
        with ThreadPoolExecutor(2) as pool:
            waits = pool.submit(_train, cluster, tmp_path, "run.name=second", "run.resources_wait_s=8")
            started = time.monotonic()
            refused = pool.submit(_train, cluster, tmp_path, "run.name=third", "run.resources_wait_s=0").result()
            refused_s = time.monotonic() - started
            waited = waits.result()
    finally:  # then the holder loses its worker node, with no restart allowed (run.max_failures=0)
        for name in list(cluster.workers):
            cluster.kill_node(name)
        held = holder.communicate(timeout=120)[0]

    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "run.resources_wait_s=0 and the workers do not fit now: 2 workers × {CPU: 1.5}" in refused.stderr
    assert re.search(r"held by run holder \(job \w+, 2 workers × \{CPU: 1\.5\}\)", refused.stderr), refused.stderr
    assert not (tmp_path / "runs" / "third").exists()

    assert waited.returncode == 1, waited.stdout[-3000:] + waited.stderr[-3000:]
    said = waited.stdout + waited.stderr
    assert "the workers' resources did not come within 8 s (run.resources_wait_s)" in said
    assert re.search(r"held by run holder \(job \w+, 2 workers × \{CPU: 1\.5\}\)", said), said[-3000:]
    assert re.search(r"^resume: raytrain-ddp train .* run\.name=second", waited.stderr, re.M), waited.stderr[-3000:]
    assert "nothing saved yet (no checkpoint in " in waited.stderr  # the command below it starts the run over

    assert holder.returncode == 1, held[-3000:]  # the final failure names the lost node, as each failure line does
    final = r"^error: run holder failed: node \S+ \(id \w{8}\) was lost, with rank [01] \(rank"
    assert re.search(final, held, re.M), held[-3000:]
    record(
        "a second run's workers do not fit next to a running one",
        attempts=1,
        checkpoints=0,
        versions=0,
        note=f"named the run holding them; gave up after run.resources_wait_s=8; with 0 refused in {refused_s:.0f} s",
    )


def test_an_elastic_run_grows_when_a_node_joins_and_goes_on_with_fewer_workers_when_it_dies(cluster, tmp_path, record):
    """scaling.num_workers=[1, 2] on the head alone: the run starts on the 1 worker there is room for.
    A node joins, and within scaling.resize_check_s (and Ray's count of the cluster) the run grows to 2;
    the node dies, and the run goes on on 1, without waiting for a node; a second elastic run with room
    for fewer than its least says it waits, and gives up after run.resources_wait_s. Then the first run is
    stopped (SIGTERM), its last checkpoint that of a whole epoch on 1 worker: train.epochs is only an upper
    bound, there for a slow machine. The global batch stays (one step: 2 workers × 1 micro-batch, or 1 × 2):
    128 steps an epoch throughout, and every epoch of every attempt trains each of its 2,048 rows once (by
    row); each attempt starts at an epoch's end, the partial epoch a resize cut short trained again whole."""
    for name in list(cluster.workers):  # the head alone (earlier tests may have left a worker node)
        cluster.kill_node(name)
    faults = tmp_path / "faults"
    faults.mkdir()
    seen: list[str] = []
    driver = _train(
        cluster,
        tmp_path,
        "scaling.num_workers=[1, 2]",
        "scaling.resize_check_s=5",
        f"train.epochs={ELASTIC_EPOCHS}",
        f"model.step_s={WATCHED_STEP_S}",
        "run.name=elastic",
        "run.max_failures=1",  # the node's loss; a resize is not counted
        f"model.fault_log={faults}",
        popen=True,
    )
    _read_until(driver, rf"^epoch +1/{ELASTIC_EPOCHS} .*, 1 worker\b", seen)
    cluster.add_node("joins")
    joined_at = time.monotonic()
    resized = _read_until(driver, r"^attempt 1 ended: (.*)$", seen)
    _read_until(driver, rf"^epoch +\d+/{ELASTIC_EPOCHS} .*, 2 workers", seen)
    grown_s = time.monotonic() - joined_at
    [(name, doomed)] = cluster.workers.items()
    cluster.kill_node(name)
    killed_at = time.monotonic()
    failed = _read_until(driver, r"^attempt 2 failed: (.*)$", seen)
    _read_until(driver, rf"^epoch +\d+/{ELASTIC_EPOCHS} .*, 1 worker\b", seen)
    shrunk_s = time.monotonic() - killed_at
    with ThreadPoolExecutor(1) as pool:
        # Meanwhile a second elastic run, of at least 2 workers × ½ CPU, where Ray Train counts room for
        # 1 next to the first run's: Ray's elastic policy waits there without a word, and with no
        # placement group to watch.
        below = pool.submit(
            _train,
            cluster,
            tmp_path,
            "scaling.num_workers=[2, 3]",
            "train.grad_accum_steps=2",
            "scaling.resources_per_worker={CPU: 0.5}",
            "run.resources_wait_s=4",
            "run.name=below-min",
        )
        for line in iter(driver.stdout.readline, ""):  # the first run's lines, meanwhile
            seen.append(line)
            if below.done():
                break
        waited = below.result()
    driver.send_signal(signal.SIGTERM)  # all shown: the epochs left would only train on
    out = "".join(seen) + driver.communicate(timeout=300)[0]

    assert driver.returncode == 143, out[-4000:]
    assert re.fullmatch(
        r"resized from 1 to 2 workers — restarted from epoch_00\d\d \(not counted in run\.max_failures\)",
        resized.group(1),
    ), resized.group(0)
    assert re.match(rf"node \S+ \(id {doomed[:8]}\) was lost, with rank [01] ", failed.group(1)), failed.group(0)
    attempts = _epochs_by_attempt(faults, rows=2048, batch_size=8)
    assert [world for world, _, _ in attempts] == [1, 2, 1]
    every_row = attempts[0][1][0]
    assert len(every_row) == 2048
    for world, epochs, _ in attempts:
        assert epochs and all(epoch == every_row for epoch in epochs), f"an epoch on {world} workers"
    run_dir = tmp_path / "runs" / "elastic"
    last = int(re.findall(rf"^epoch +(\d+)/{ELASTIC_EPOCHS} ", out, re.M)[-1])  # the last epoch shown before the stop
    final = ckpt.open_verified(run_dir / f"epoch_{last:04d}").metrics()
    assert (final["step"], final["workers"]) == (last * 128, 1)  # 128 steps an epoch on either
    assert waited.returncode == 1, waited.stdout[-3000:] + waited.stderr[-3000:]
    said = waited.stdout + waited.stderr
    assert "resources did not come within 4 s (run.resources_wait_s): 2–3 workers (elastic) × {CPU: 0.5}" in said
    wasted = sum(partial for _, _, partial in attempts[:-1])  # the last one's: where SIGTERM stopped it
    record(
        "an elastic run (`scaling.num_workers=[1, 2]`) on the head alone; a node joins, then dies",
        attempts=3,
        resumed="the epoch's end before each resize",
        wasted=f"{wasted} micro-batches (the partial epochs cut short)",
        checkpoints=len(list(run_dir.glob("epoch_*"))),
        versions="0 (stopped)",
        note=f"on 2 workers {grown_s:.0f} s after the node joined; on 1 again {shrunk_s:.0f} s after it died; "
        "each epoch's rows once, 128 steps an epoch throughout",
    )


def _epochs_by_attempt(faults: Path, rows: int, batch_size: int) -> list[tuple[int, list[list[str]], int]]:
    """For each attempt in order, from tiny's logs: its world size, the rows (sorted) of each of its
    whole epochs over all its ranks, and its micro-batches past the last whole epoch. Rank 0 is in
    every attempt; rank 1 in those of 2 workers."""
    ranks = {}
    for rank in (0, 1):
        passes: dict[str, list[list[str]]] = {}  # "<world size>:<pid>": the rows of each pass
        for tag, batch in tiny_passes(faults / f"rows{rank}.log"):
            passes.setdefault(tag, []).append(batch)
        ranks[rank] = iter(passes.items())
    attempts = []
    for tag, own in ranks[0]:
        world = int(tag.split(":")[0])
        logs = [own, *(next(ranks[1])[1] for _ in range(world - 1))]
        per_epoch = rows // world // batch_size
        whole = min(len(log) for log in logs) // per_epoch
        epochs = [
            sorted(row for log in logs for batch in log[e * per_epoch : (e + 1) * per_epoch] for row in batch)
            for e in range(whole)
        ]
        attempts.append((world, epochs, len(own) - whole * per_epoch))
    return attempts
