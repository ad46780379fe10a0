"""Training for real: 2 DDP workers on a local Ray (gloo), digits read through Ray Data, MLflow on sqlite.

One straight 3-epoch run is shared by the checks on sharding, global validation, checkpoints and
MLflow. (Exact resume, after a restart, a crash or a damaged checkpoint, is test_reliability.py's.)
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from sklearn.datasets import load_digits

from raytrain_ddp import ConfigError, load_config, with_overrides
from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.config import recipe as recipes
from raytrain_ddp.worker.metrics import reported_metrics

# Checkpoints ranked by val_loss: accuracy (k/360) ties.
SETTINGS = (
    "train.lr_schedule=constant",
    "checkpoint.num_to_keep=1",
    "checkpoint.score_attribute=val_loss",
    "checkpoint.score_order=min",
)
DIGITS_TRAIN_ROWS, DIGITS_VAL_ROWS = 1437, 360
STEPS_PER_EPOCH = 23  # 718 rows per worker in batches of 32
EPOCHS = 3
STEPS = EPOCHS * STEPS_PER_EPOCH


class _Preparing(logging.Handler):
    """When a driver began preparing its registration (model_logging.Rehearsal.start's debug line)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.began: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("preparing model logging ahead"):
            self.began.append(record.created)


PREPARING = _Preparing()  # the straight run's


@pytest.fixture(scope="module")
def straight(ray_session, module_workspace):
    import mlflow

    from raytrain_ddp import run
    from raytrain_ddp.cluster import prestart

    config = load_config(
        "digits",
        # Checkpoints uploaded in the background: what they leave is checked as synchronous ones are.
        overrides=module_workspace.overrides(
            *SETTINGS, f"train.epochs={EPOCHS}", "checkpoint.upload=async", "run.name=straight", "run.progress_log_s=1"
        ),
    )
    # As a new driver process: nothing asked for yet. This pytest process's Ray serves other modules'
    # runs, and a run of theirs refused after asking leaves a record that makes this run take the
    # processes it asked for rather than ask; where the raylet had started only part of them (its start
    # slots busy), one of this run's would start after fit() began (seen once in CI).
    prestart._idle.clear()
    notebook_uri = f"sqlite:///{module_workspace.root / 'notebook.db'}"  # as if a notebook had its own
    mlflow.set_tracking_uri(notebook_uri)
    out = io.StringIO()  # no terminal: as a log, or `ray job logs`
    tracking_log = logging.getLogger("raytrain_ddp.registry.model_logging")
    level = tracking_log.level
    tracking_log.addHandler(PREPARING)
    tracking_log.setLevel(logging.DEBUG)
    try:
        summary = run(config, console=Console(file=out, width=1000))
    finally:
        tracking_log.removeHandler(PREPARING)
        tracking_log.setLevel(level)
    assert mlflow.get_tracking_uri() == notebook_uri, "run() must leave the caller's MLflow tracking URI alone"
    return summary, config, out.getvalue()


def test_each_worker_trains_on_half_of_the_rows_every_epoch(straight):
    summary, *_ = straight
    assert summary.epochs == EPOCHS
    per_worker = DIGITS_TRAIN_ROWS // 2  # equal shares: the odd row is left out
    assert summary.final_metrics["train_samples_per_worker"] == [per_worker, per_worker]
    assert summary.final_metrics["train_samples"] == 2 * per_worker
    assert summary.final_metrics["train_batches"] == 2 * int(np.ceil(per_worker / 32))


def test_validation_counts_every_row_exactly_once_across_ranks(straight):
    summary, *_ = straight
    per_worker = summary.final_metrics["val_samples_per_worker"]
    assert summary.final_metrics["val_samples"] == sum(per_worker) == DIGITS_VAL_ROWS
    assert len(per_worker) == 2 and min(per_worker) > 0  # both ranks evaluated a share


def test_a_log_gets_plain_progress_lines_between_the_report_lines(straight):
    """No terminal: a progress line at most every run.progress_log_s (1 s here), with the step of the
    run's 69, the loss, samples/s and the ETA, and never a control character."""
    *_, out = straight
    assert "\x1b" not in out and "\r" not in out
    lines = out.splitlines()
    progress = [
        re.fullmatch(rf"progress: step (\d+)/{STEPS} \(\d+%\)  epoch ([\d.]+)/{EPOCHS}  loss [\d.]+  (.*)", line)
        for line in lines
    ]
    steps = [int(m.group(1)) for m in progress if m]
    assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] <= STEPS, out
    assert any("samples/s" in m.group(3) and re.search(r"ETA \d+[ms]", m.group(3)) for m in progress if m), out
    reports = [line for line in lines if re.match(rf"epoch +\d/{EPOCHS} ", line)]
    assert len(reports) == EPOCHS  # a line per report stays


def test_checkpoints_live_under_the_run_and_num_to_keep_holds(straight, module_workspace):
    summary, config, _ = straight
    run_dir = module_workspace.storage / "straight"
    assert Path(summary.run_path) == run_dir
    kept = sorted(p.name for p in run_dir.glob("epoch_*"))
    history = _metric_history(summary, "val_loss")
    best_epoch = min(history, key=history.get) // STEPS_PER_EPOCH
    # Ray keeps the num_to_keep best by score and, for resuming, always the latest.
    assert kept == sorted({f"epoch_{best_epoch:04d}", f"epoch_{EPOCHS:04d}"})
    assert Path(summary.best_checkpoint) == run_dir / f"epoch_{best_epoch:04d}"
    for directory in run_dir.glob("epoch_*"):
        saved = ckpt.open_verified(directory).config()
        assert saved["run"]["name"] == "straight" and saved["train"] == config.to_dict()["train"]


def test_mlflow_has_one_run_with_live_metric_history_and_one_registered_version(straight):
    from mlflow.tracking import MlflowClient

    summary, *_ = straight
    client = MlflowClient(summary.tracking_uri)
    [run] = client.search_runs(
        [client.get_experiment_by_name("digits").experiment_id],
        filter_string="tags.`raytrain_ddp.run_name` = 'straight'",
    )
    assert run.info.status == "FINISHED" and run.info.run_id == summary.mlflow_run_id
    assert run.data.params["train.epochs"] == str(EPOCHS) and run.data.params["scaling.num_workers"] == "2"
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [23, 46, 69]  # MLflow's step is the optimizer step
    epochs = client.get_metric_history(run.info.run_id, "epoch")
    assert sorted((m.step, m.value) for m in epochs) == [(23, 1.0), (46, 2.0), (69, 3.0)]
    # Logged as each epoch was reported, not all at the end: an epoch takes seconds here.
    logged_at = sorted(m.timestamp for m in history)
    assert all(later - earlier > 1000 for earlier, later in zip(logged_at, logged_at[1:]))
    [version] = client.search_model_versions("name = 'digits-resnet18'")
    assert int(version.version) == summary.model.version == 1 and version.run_id == run.info.run_id
    assert summary.model.uri == "models:/digits-resnet18/1"


def test_only_the_driver_imports_mlflow_and_the_controller_no_torch(ray_session):
    """MLflow is the driver's alone (it logs each report's metrics as the report reaches it: the live
    metric history above), and Ray Train's controller needs no torch: in a new Ray worker process,
    what the controller unpickles before it starts a worker (the run's callbacks and the backend
    config) imports neither (each a second and more of every run's start), and what the workers run
    besides (the loop) imports no mlflow."""
    import ray
    from ray.util.queue import Queue

    from raytrain_ddp.controller.callbacks import ControllerMarks, ProgressRelay
    from raytrain_ddp.ray_compat.torch_backend import ProcessGroupConfig

    @ray.remote(num_cpus=0)
    class Process:
        def loaded(self, unpickled: list, also: str | None = None) -> set[str]:  # Ray unpickles them here
            import importlib
            import sys

            if also:
                importlib.import_module(also)
            return {"torch", "mlflow"} & sys.modules.keys()

    queue = Queue(actor_options={"num_cpus": 0})
    process = Process.remote()
    try:
        controllers = [ProgressRelay(queue, None), ControllerMarks(queue), ProcessGroupConfig()]
        assert ray.get(process.loaded.remote(controllers)) == set()
        assert ray.get(process.loaded.remote([], also="raytrain_ddp.worker.loop")) == {"torch"}  # what the workers run
    finally:
        ray.kill(process)
        ray.kill(queue.actor)


def test_the_controller_and_workers_are_the_processes_the_driver_started_ahead(straight, module_workspace):
    """On a Ray of one node the driver asks the raylet for the workers' processes as it joins, and for
    the controller's and its synchronization actor's once the datasets are built (prestart.py); Ray
    Train's are those: the controller's and the synchronization actor's launched before fit() began,
    the workers' before the controller started, where processes Ray started for them would be launched
    after (Ray's own record of the run's actors and worker processes)."""
    import json

    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    marks = dict(json.loads((module_workspace.storage / "straight" / "timeline.json").read_text())["marks"])
    fit_ms = (marks["mlflow"] * 1e3, marks["fit returned"] * 1e3)
    during = [a for a in state.actor_table(None).values() if fit_ms[0] <= a["StartTime"] <= fit_ms[1]]
    [controller] = [a for a in during if a["ActorClassName"] == "TrainController"]
    [sync] = [a for a in during if a["ActorClassName"] == "SynchronizationActor"]
    workers = [a for a in during if a["ActorClassName"] == "RayTrainWorker"]
    launched = {
        (w := gcs_pb2.WorkerTableData.FromString(row)).pid: w.worker_launch_time_ms
        for row in state._connect_and_get_accessor().get_worker_table()
    }
    assert len(workers) == 2
    assert launched[controller["Pid"]] < fit_ms[0] and launched[sync["Pid"]] < fit_ms[0], (controller, sync, launched)
    assert all(launched[w["Pid"]] < controller["StartTime"] for w in workers), (controller, workers, launched)


def test_the_registration_is_prepared_once_the_ranks_train_not_while_ray_train_starts(straight, module_workspace):
    """The driver's rehearsal of the model logging begins after rank 0's first step: while Ray Train
    started it took a core from a cluster of another session (bench/README.md)."""
    import json

    marks = dict(json.loads((module_workspace.storage / "straight" / "timeline.json").read_text())["marks"])
    [began] = PREPARING.began
    assert marks["first step"] < began < marks["fit returned"], (marks, began)


def test_a_process_asks_once_for_the_workers_a_run_refused_after_asking_left(straight):
    """The raylet starts as many processes as it is asked for, whatever it has idle: a run refused after
    its driver asked (a notebook's, the tests') leaves them for the next run of the process to take,
    rather than two more processes each time."""
    from raytrain_ddp.cluster import prestart

    _, config, _ = straight
    assert prestart.start(config) == 2
    assert prestart.start_controller(config) == 2
    assert prestart.start(config) == 0  # those are still idle: the next fit() takes them
    assert prestart.start_controller(config) == 0
    assert prestart.start(with_overrides(config, "run.prestart_workers=false")) == 0
    assert prestart.start_controller(with_overrides(config, "run.prestart_workers=false")) == 0


def test_the_registered_model_reproduces_the_reported_validation_accuracy(straight):
    import mlflow

    summary, config, _ = straight
    mlflow.set_tracking_uri(summary.tracking_uri)
    model = mlflow.pytorch.load_model(summary.model.uri)
    val = recipes.load("digits").build_datasets(seed=config.seed, **config.dataset)["val"]
    batch = val.take_all()
    pixels = np.stack([row["pixels"] for row in batch])
    digits = load_digits().data  # raw scans in: pixel values 0..16, the model normalizes them itself
    assert pixels.shape == (DIGITS_VAL_ROWS, 64) and all((digits == row).all(axis=1).any() for row in pixels)
    labels = np.array([row["label"] for row in batch])
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(pixels)).argmax(dim=1).numpy() == labels).mean())
    assert len(labels) == DIGITS_VAL_ROWS
    assert accuracy == pytest.approx(summary.metrics["val_accuracy"], abs=1e-9)
    assert accuracy >= 0.9


def test_every_report_carries_the_metrics_the_driver_checks_against(straight):
    summary, *_ = straight
    assert set(summary.final_metrics) == reported_metrics(["loss", "accuracy"], counts_tokens=False)


def test_a_resume_that_would_change_the_computation_is_refused_before_training(straight, module_workspace):
    from mlflow.tracking import MlflowClient

    from raytrain_ddp import run

    summary, config, _ = straight
    changed = with_overrides(config, "train.lr=0.01", "scaling.num_workers=1", f"train.epochs={EPOCHS + 1}")
    with pytest.raises(ConfigError) as refused:
        run(changed)
    assert [p.split(":")[0] for p in refused.value.problems] == ["scaling.num_workers", "train.lr"]
    assert "was 0.002 when the run started, now 0.01" in str(refused.value)  # train.epochs may change
    assert sorted(p.name for p in Path(summary.run_path).glob("epoch_*"))[-1] == f"epoch_{EPOCHS:04d}"
    client = MlflowClient(summary.tracking_uri)
    assert client.get_run(summary.mlflow_run_id).info.status == "FINISHED"
    assert len(client.search_model_versions(f"run_id = '{summary.mlflow_run_id}'")) == 1


def test_a_score_metric_the_loop_never_reports_is_refused_before_training(ray_session, workspace):
    from raytrain_ddp import run

    config = load_config("digits", overrides=workspace.overrides("checkpoint.score_attribute=val_f1"))
    with pytest.raises(ConfigError, match=r"'val_f1' is not a reported metric; choose one of: .*val_accuracy"):
        run(config)
    assert workspace.untouched()


def _metric_history(summary, key: str) -> dict[int, float]:
    """{optimizer step: value}"""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(summary.tracking_uri).get_metric_history(summary.mlflow_run_id, key)
    return {m.step: m.value for m in history}
