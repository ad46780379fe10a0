"""Failures, for real: faults injected into the tiny recipe's workers (tests/jobs/tiny.py) on a local
Ray; checkpoints damaged on disk; resources the cluster does not have. (A second driver and a killed
driver are in test_cli.py: they need processes of their own.)

Each scenario records its figures (attempts, where it resumed, steps trained twice, checkpoints left,
MLflow versions) for the table printed at the end of the session; the README's reliability section
shows the latest.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from services import tiny_passes

from raytrain_ddp import ConfigError, load_config
from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.config import recipe as recipes

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")

# 96 rows over 2 workers, batch 8: 6 steps an epoch, 18 in all. A checkpoint every 4 steps and at each
# epoch's end: steps 4, 6 | 8, 12 | 16, 18. Every switch that takes randomness or state is on
# (dropout, per-epoch shuffle, bf16, clipping, warmup, parameters without gradients), so an exact
# resume has to restore all of it. Constant LR after warmup: 2 epochs + 1 more follows the same
# schedule as 3.
RELIABLE = (
    "dataset.rows=96",
    "train.epochs=3",
    "train.lr=0.1",
    "train.warmup_steps=4",
    "train.grad_clip_norm=5.0",
    "train.precision=bf16",
    "model.dropout=0.3",
    "model.unused_branch=true",
    "ddp.find_unused_parameters=true",
    "checkpoint.every_n_steps=4",
    "checkpoint.num_to_keep=null",
)


def _run(workspace, *overrides: str):
    from raytrain_ddp import run

    return run(load_config(TINY, overrides=workspace.overrides(*RELIABLE, *overrides)))


def _faults(workspace, *faults: str) -> tuple[str, str]:
    log = workspace.root / "faults"
    log.mkdir(exist_ok=True)
    return f"model.faults=[{', '.join(faults)}]", f"model.fault_log={log}"


def _attempts(workspace, rank: int) -> list[int]:
    """Training passes rank `rank` made in each attempt (its log holds one pid per pass)."""
    pids = (workspace.root / "faults" / f"rank{rank}.log").read_text().split()
    return [pids.count(pid) for pid in dict.fromkeys(pids)]


def _rows(log: Path) -> list[str]:
    """The rows a rank trained on, pass after pass."""
    return [row for _, rows in tiny_passes(log) for row in rows]


def _checkpoints(run_dir: Path) -> dict[str, str]:
    """Every checkpoint directory left on storage, with what verification says of it (beside them, a
    failed run's errors/ holds the workers' tracebacks)."""
    verdicts = {}
    for directory in sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("epoch_")):
        try:
            ckpt.verify(directory)
            verdicts[directory.name] = "verified"
        except ckpt.CheckpointError as e:
            verdicts[directory.name] = str(e)
    return verdicts


def _versions(tracking_uri: str) -> int:
    from mlflow.tracking import MlflowClient

    return len(MlflowClient(tracking_uri).search_model_versions("name = 'tiny'"))


def _weights(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    return ckpt.open_verified(run_dir / name).model_state()


@pytest.fixture(scope="module")
def straight(ray_session, module_workspace):
    """The uninterrupted run every resumed one must equal."""
    return _run(module_workspace, "run.name=straight", "mlflow.register=never")  # its copy registers


def test_the_uninterrupted_run_checkpoints_every_4_steps_and_at_each_epoch_end(straight):
    run_dir = Path(straight.run_path)
    assert _checkpoints(run_dir) == {
        name: "verified"
        for name in (
            "epoch_0001",
            "epoch_0001-step_0000004",
            "epoch_0002",
            "epoch_0002-step_0000008",
            "epoch_0003",
            "epoch_0003-step_0000016",
        )
    }
    assert straight.attempts == 1 and straight.failures == []
    assert (
        straight.final_metrics["train_loss"] < 0.5 * ckpt.open_verified(run_dir / "epoch_0001").metrics()["train_loss"]
    )
    mid_epoch = ckpt.open_verified(run_dir / "epoch_0002-step_0000008")
    assert (mid_epoch.training_state().epoch, mid_epoch.training_state().batches) == (1, 2)
    assert mid_epoch.metrics()["epoch"] == pytest.approx(1 + 2 / 6)
    weights = _weights(run_dir, "epoch_0003")
    torch.manual_seed(0)
    untrained = recipes.load(TINY).build_model(dropout=0.3, unused_branch=True).state_dict()
    torch.testing.assert_close(weights["unused.weight"], untrained["unused.weight"])  # never got a gradient
    assert not torch.equal(weights["body.0.weight"], untrained["body.0.weight"])


def test_workers_killed_right_after_a_report_and_mid_epoch_resume_exactly(straight, workspace, record):
    """Rank 1 exits at its first pass after the epoch-1 report (the checkpoint just reported must not
    be lost), then is SIGKILLed at step 11, 3 steps after the step-8 checkpoint: the run resumes twice
    and ends with the uninterrupted run's weights, bit for bit."""
    summary = _run(
        workspace, *_faults(workspace, "'1:7:exit'", "'1:12:kill'"), "run.max_failures=2", "run.name=faulted"
    )

    assert summary.attempts == 3
    assert "rank 1: the worker process died" in summary.failures[0]
    assert summary.failures[0].endswith("restarted from epoch_0001")
    assert summary.failures[1].endswith("restarted from epoch_0002-step_0000008")
    # Passes per attempt: 7 (the 7th fatal), 5 (steps 7-11, the 11th fatal), then steps 9-18.
    assert _attempts(workspace, rank=1) == [7, 5, 10]
    wasted = (7 - 1) + (5 - 1) + 10 - 18  # steps completed in all attempts, less the run's steps
    run_dir = Path(summary.run_path)
    torch.testing.assert_close(
        _weights(run_dir, "epoch_0003"), _weights(Path(straight.run_path), "epoch_0003"), rtol=0, atol=0
    )
    assert summary.final_metrics["train_loss"] == straight.final_metrics["train_loss"]  # epoch totals survive too
    checkpoints = _checkpoints(run_dir)
    assert set(checkpoints.values()) == {"verified"}
    assert _versions(summary.tracking_uri) == 1
    assert wasted <= 4  # at most one checkpoint interval
    record(
        "worker os._exit right after a report, then SIGKILL mid-epoch (max_failures=2)",
        attempts=3,
        resumed="epoch_0001 (step 6); epoch_0002-step_0000008 (step 8)",
        wasted=f"0; {wasted}",
        checkpoints=len(checkpoints),
        versions=1,
    )


def test_a_fault_that_repeats_stops_after_max_failures_plus_one_attempts(ray_session, workspace, record):
    from mlflow.tracking import MlflowClient

    from raytrain_ddp import RunFailed

    with pytest.raises(RunFailed) as failed:  # a lazy Ray Dataset: Ray Train's Ray Data path, resumed too
        _run(
            workspace,
            *_faults(workspace, "'1:7:raise'"),
            "run.max_failures=1",
            "run.name=doomed",
            "dataset.source=lazy-ray",
        )

    message = str(failed.value)
    assert "rank 1: RuntimeError: injected fault at training pass 8 of rank 1" in message  # attempt 2's first pass
    assert "(attempt 2; run.max_failures=1)" in message
    assert _attempts(workspace, rank=1) == [7, 1]
    run_dir = workspace.storage / "doomed"
    checkpoints = _checkpoints(run_dir)
    assert checkpoints == {"epoch_0001": "verified", "epoch_0001-step_0000004": "verified"}
    assert ckpt.open_verified(run_dir / "epoch_0001").metrics()["step"] == 6  # the last good one, whole
    [log] = (run_dir / "errors").glob("*.log")  # the workers' full tracebacks, named in the message
    assert f"the workers' full tracebacks: {log}" in message and "Traceback" in log.read_text()
    client = MlflowClient(workspace.tracking_uri)
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert mlflow_run.info.status == "FAILED" and _versions(workspace.tracking_uri) == 0
    record(
        "a fault on every attempt (max_failures=1)",
        attempts=2,
        resumed="epoch_0001 (step 6)",
        wasted="0; 0",
        checkpoints=len(checkpoints),
        versions=0,
    )


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("'0:7:nan'", "training diverged: the training loss is nan at step 8 (epoch 1.333); lower train.lr"),
        ("'*:7:noscore'", "checkpoint.score_attribute 'val_mse' is missing from the report at step 8"),
    ],
    ids=["nan-loss", "score-missing"],
)
def test_a_run_that_cannot_go_on_stops_at_once_and_keeps_its_best_checkpoint(
    ray_session, workspace, record, fault, says
):
    """No retry would help: every rank sees the same global metrics and stops at the same report, with
    no checkpoint; Ray never ranks a report without the score (it would rank it best)."""
    from raytrain_ddp import RunFailed

    with pytest.raises(RunFailed, match=re.escape(says)):
        _run(workspace, *_faults(workspace, fault), "run.max_failures=2", "run.name=stopped")

    assert len(_attempts(workspace, rank=0)) == 1  # no retries
    checkpoints = _checkpoints(workspace.storage / "stopped")
    assert checkpoints == {"epoch_0001": "verified", "epoch_0001-step_0000004": "verified"}
    assert _versions(workspace.tracking_uri) == 0
    record(
        f"{'NaN loss' if 'nan' in fault else 'report without the score'} (max_failures=2)",
        attempts=1,
        resumed="-",
        wasted="-",
        checkpoints=len(checkpoints),
        versions=0,
    )


def test_a_damaged_checkpoint_is_skipped_for_the_newest_that_verifies(straight, workspace, record):
    from raytrain_ddp import RunFailed

    run_dir = workspace.storage / "straight"  # a copy of the finished run (Ray's record names its
    shutil.copytree(straight.run_path, run_dir)  # checkpoints relative to the run directory)
    _flip_a_byte(run_dir / "epoch_0003" / ckpt.MODEL_FILE)

    resumed = _run(workspace, "run.name=straight")

    assert resumed.resumed.checkpoint == "epoch_0003-step_0000016"
    assert resumed.resumed.skipped == [
        "epoch_0003: model.pt does not match its checksum (the bytes changed after it was written)"
    ]
    # Steps 17 and 18 trained again, into a directory of their own: the damaged one is evidence, not overwritten.
    torch.testing.assert_close(
        _weights(run_dir, "epoch_0003-retrained"), _weights(Path(straight.run_path), "epoch_0003"), rtol=0, atol=0
    )
    checkpoints = _checkpoints(run_dir)
    assert "checksum" in checkpoints.pop("epoch_0003") and set(checkpoints.values()) == {"verified"}
    assert Path(resumed.best_checkpoint).name == "epoch_0003-retrained"  # the damaged best was not registered
    assert _versions(workspace.tracking_uri) == 1
    record(
        "a flipped byte in the newest (and best) checkpoint",
        attempts=1,
        resumed="epoch_0003-step_0000016 (step 16)",
        wasted=2,
        checkpoints=f"{len(checkpoints) + 1} (1 damaged)",
        versions=1,
    )

    # Every checkpoint damaged, each in one of four ways: the run stops before training and says why.
    damages = [
        lambda d: (d / ckpt.MODEL_FILE).write_bytes((d / ckpt.MODEL_FILE).read_bytes()[:-10]),
        lambda d: (d / ckpt.STATE_FILE).unlink(),
        lambda d: (d / ckpt.MANIFEST_FILE).unlink(),
        lambda d: _flip_a_byte(d / ckpt.STATE_FILE),
    ]
    for i, name in enumerate(checkpoints):
        damages[i % len(damages)](run_dir / name)
    started = time.monotonic()
    with pytest.raises(RunFailed, match="run straight cannot resume: not one checkpoint verifies") as refused:
        _run(workspace, "train.epochs=4", "run.name=straight")
    for reason in (
        "model.pt is truncated",
        "train_state.pt is missing",
        "no manifest.json",
        "train_state.pt does not match",
    ):
        assert reason in str(refused.value)
    record(
        "every checkpoint damaged (truncated, file missing, no manifest, flipped byte)",
        attempts=0,
        resumed="-",
        wasted="-",
        checkpoints="all damaged",
        versions=0,
        note=f"refused in {time.monotonic() - started:.1f} s",
    )


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["scaling.num_workers=3", "scaling.resources_per_worker={CPU: 1}"],
            "scaling: 3 workers × CPU 1 need CPU 3, the cluster has 2 (1 node(s): CPU 2)",
        ),
        (["scaling.resources_per_worker={CPU: 1.5}"], "scaling: 2 workers × CPU 1.5 need CPU 3, the cluster has 2"),
        (
            ["scaling.use_gpu=true"],
            "scaling: 2 workers × GPU 1 need GPU 2, the cluster has 0 (1 node(s): CPU 2); set scaling.use_gpu=false",
        ),
        (
            ["scaling.resources_per_worker={CPU: 1}", "dataset.source=lazy-ray"],
            "the workers take 2 of 2 CPUs, and Ray Data needs one",
        ),
        (
            ["scaling.label_selector={role: train}"],
            "scaling.label_selector: no node of the cluster has the labels role=train (they have: none); "
            "start nodes with --labels role=train",
        ),
    ],
    ids=["too-many-workers", "too-many-cpus", "no-gpus", "no-cpu-left-for-ray-data", "no-node-with-the-labels"],
)
def test_resources_the_cluster_cannot_hold_are_refused_before_training(ray_session, workspace, record, overrides, says):
    from raytrain_ddp import run

    started = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(says)):
        run(load_config(TINY, overrides=workspace.overrides(*overrides)))
    seconds = time.monotonic() - started

    assert workspace.untouched()
    assert seconds < 60  # Ray itself would wait for these resources forever
    record(
        f"resources: {says.split(';')[0][:60]}…",
        attempts=0,
        resumed="-",
        wasted="-",
        checkpoints=0,
        versions=0,
        note=f"refused in {seconds:.1f} s",
    )


def test_a_run_whose_workers_never_fit_gives_up_and_frees_its_placement_group_but_not_the_callers(
    ray_session, workspace, record
):
    """A driver that lives on (a notebook): the caller's own placement group holds 1 of the 2 CPUs (the
    other builds the datasets), so the run's workers (2 × 0.75) wait; after run.resources_wait_s the
    driver kills Ray Train's controller, and the workers' pending placement group, which outlives its
    controller, is removed (Ray Train's own cleaner is not started); the caller's is untouched."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from raytrain_ddp import RunFailed, run
    from raytrain_ddp.cluster import capacity

    own = placement_group([{"CPU": 1}])
    ray.get(own.ready(), timeout=30)
    try:
        started = time.monotonic()
        with pytest.raises(RunFailed, match=re.escape("did not come within 3 s (run.resources_wait_s)")):
            run(
                load_config(
                    TINY,
                    overrides=workspace.overrides("scaling.resources_per_worker={CPU: 0.75}", "run.resources_wait_s=3"),
                )
            )
        seconds = time.monotonic() - started
        assert capacity.placement_groups() == {own.id.hex(): "CREATED"}
        assert placement_group_table(own)["state"] == "CREATED"
    finally:
        remove_placement_group(own)
    record(
        "workers never placed, driver lives on",
        attempts=0,
        resumed="-",
        wasted="-",
        checkpoints=0,
        versions=0,
        note=f"gave up in {seconds:.0f} s; its placement group removed, the caller's kept",
    )


def test_a_run_resumed_on_fewer_workers_then_more_keeps_its_global_batch_and_trains_each_row_once_an_epoch(
    ray_session, workspace, record
):
    """2 workers, a checkpoint every 2 steps, rank 1 killed at the end of epoch 2 (its newest
    checkpoint mid-epoch); then 1 worker accumulating 2 micro-batches a step: it resumes from the end
    of epoch 1 (the mid-epoch position is one in the 2 workers' data), with the same 4 optimizer steps
    an epoch, and trains epochs 2 and 3 with each of their 64 rows once; then 2 workers again, for
    epoch 4."""
    from mlflow.tracking import MlflowClient

    from raytrain_ddp import RunFailed, run

    def resumed(*overrides: str):
        settings = ("run.name=resized", "train.epochs=3", "checkpoint.every_n_steps=2", "checkpoint.num_to_keep=null")
        settings += ("mlflow.register=never",)
        return run(
            load_config(TINY, overrides=workspace.overrides(*settings, *_faults(workspace, "'1:8:kill'"), *overrides))
        )

    with pytest.raises(RunFailed):
        resumed()
    faults = workspace.root / "faults"
    rows = {row for rank in (0, 1) for row in _rows(faults / f"rows{rank}.log")}  # both ranks'
    for log in faults.glob("*.log"):
        log.rename(log.with_suffix(".first"))
    with pytest.raises(ConfigError, match="scaling.num_workers: the run steps on 2 micro-batches"):
        resumed("scaling.num_workers=1")  # without the accumulation that keeps the global batch

    done = resumed("scaling.num_workers=1", "train.grad_accum_steps=2")

    assert done.resumed.checkpoint == "epoch_0001"
    assert done.resumed.skipped == ["epoch_0002-step_0000006: mid-epoch, a position in the data of 2 workers, not 1"]
    trained = _rows(faults / "rows0.log")
    assert not (faults / "rows1.log").exists()  # one rank
    assert len(rows) == 64 and sorted(trained[:64]) == sorted(trained[64:]) == sorted(rows)  # each row once an epoch
    run_dir = workspace.storage / "resized"
    assert ckpt.open_verified(run_dir / "epoch_0003").metrics()["step"] == 12  # 4 steps an epoch, as on 2 workers
    checkpoints = _checkpoints(run_dir)
    assert "epoch_0002-step_0000006-retrained" in checkpoints and set(checkpoints.values()) == {"verified"}
    client = MlflowClient(workspace.tracking_uri)
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert mlflow_run.data.tags["changed_on_resume.scaling.num_workers"] == "1"

    for log in faults.glob("*.log"):
        log.rename(log.with_suffix(".second"))
    grown = resumed("train.epochs=4")  # back on the run's own 2 workers × 1 micro-batch, for one epoch more

    assert grown.resumed.checkpoint == "epoch_0003"
    epoch_4 = [row for rank in (0, 1) for row in _rows(faults / f"rows{rank}.log")]
    assert sorted(epoch_4) == sorted(rows)  # split over two ranks again (each seeded afresh), each row once
    assert ckpt.open_verified(run_dir / "epoch_0004").metrics()["step"] == 16
    record(
        "rank 1 SIGKILLed at the end of epoch 2 (newest checkpoint mid-epoch); resumed by hand on 1 worker × 2 "
        "accumulated, then on 2 again for epoch 4",
        attempts="3 runs",
        resumed="epoch_0001 (passing over epoch_0002-step_0000006), then epoch_0003",
        wasted=2,
        checkpoints=len(checkpoints),
        versions=1,
        note="4 steps an epoch on both; epochs 2, 3 and 4: 64 rows each once",
    )


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs, unmounted after the test: a disk that fills up. Mounting needs root, which CI has."""
    where = tmp_path / "small-disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        message = f"could not mount a tmpfs (this test needs root, as CI has): {mounted.stderr.decode().strip()}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_stops_the_run_keeping_nothing_half_written_and_it_resumes_once_space_is_freed(
    ray_session, workspace, small_disk, record
):
    from raytrain_ddp import RunFailed, run

    width = 65536  # model.pt holds 6 × width + 1 floats: a checkpoint of about 1.6 MB
    checkpoint_bytes = 4 * (6 * width + 1)
    filler = small_disk / "filler"  # leaves room for one checkpoint and a half
    filler.write_bytes(bytes(8 * 2**20 - int(1.5 * checkpoint_bytes)))
    config = load_config(
        TINY,
        overrides=workspace.overrides(
            f"run.storage_path={small_disk}", "run.name=full", "train.epochs=3", f"model.width={width}", "train.lr=1e-5"
        ),
    )

    started = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        run(config)
    seconds = time.monotonic() - started

    message = str(failed.value)
    assert f"checkpoint epoch_0002 could not be written to {small_disk}/full/epoch_0002" in message
    assert "No space left on device" in message and "the storage is full: free space there" in message
    assert "resume: " in message
    assert _checkpoints(small_disk / "full") == {"epoch_0001": "verified"}  # nothing of epoch_0002 was kept

    filler.unlink()
    resumed = run(config)

    assert resumed.resumed.checkpoint == "epoch_0001"
    assert _checkpoints(small_disk / "full") == {"epoch_0002": "verified", "epoch_0003": "verified"}
    assert _versions(workspace.tracking_uri) == 1
    record(
        "storage full (an 8 MiB tmpfs) while checkpoint 2 was written; space freed, run again",
        attempts="2 runs",
        resumed="epoch_0001",
        wasted="4 (epoch 2 again)",
        checkpoints=2,
        versions=1,
        note=f"stopped {seconds:.0f} s after the start, at the full disk",
    )


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


FORMAT_1 = Path(__file__).parents[1] / "fixtures" / "checkpoint-format-1"


def test_a_checkpoint_written_before_the_package_layout_resumes_where_it_stopped(ray_session, workspace, monkeypatch):
    """A run directory written by the service as it was before its modules moved into packages (the
    tiny job as `./jobs/tiny.py`, 1 of 2 epochs; `weights-after-2-epochs.pt`: that service's own
    uninterrupted 2 epochs) resumes, trains its second epoch and ends where the old service ended."""
    from raytrain_ddp import run

    name = "written-before-the-layout"
    shutil.copytree(FORMAT_1 / name, workspace.storage / name)
    (workspace.root / "jobs").mkdir()
    for part in ("tiny.py", "tiny.yaml"):  # the job by name, as the run was started: its saved config says so
        shutil.copy(Path(TINY).with_name(part), workspace.root / "jobs" / part)
    monkeypatch.chdir(workspace.root)
    overrides = workspace.overrides(f"run.name={name}", "train.epochs=2", "mlflow.register=never")
    summary = run(load_config("tiny", overrides=overrides))
    assert (summary.resumed.checkpoint, summary.resumed.epoch, summary.epochs) == ("epoch_0001", 1, 2)
    resumed = _weights(Path(summary.run_path), "epoch_0002")
    expected = torch.load(FORMAT_1 / "weights-after-2-epochs.pt", weights_only=True)
    assert resumed.keys() == expected.keys()
    for key, value in expected.items():  # the same computation; another CPU may round the last bits
        torch.testing.assert_close(resumed[key], value, rtol=1e-4, atol=1e-6)
