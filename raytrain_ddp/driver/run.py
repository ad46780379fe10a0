"""`run(config) -> RunSummary`: one training run, from the CLI or a notebook.

    from raytrain_ddp import load_config, run
    summary = run(load_config("digits", overrides=["train.epochs=3"]))

A run is: plan (resolve names and paths, join or start Ray, build the datasets, find where the run
stands) -> checks (everything that can refuse it before a worker starts) -> fit (a TorchTrainer of
`loop.train_loop_per_worker`, holding the run's lease) -> register (the best verified checkpoint's
model, in MLflow, as `mlflow.register` says) -> summary.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ray.train
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, WorkerGroupError
from ray.train.torch import TorchTrainer
from rich.console import Console

from raytrain_ddp.checkpoint import lease, storage
from raytrain_ddp.cluster import capacity, prestart, session
from raytrain_ddp.config.schema import Config
from raytrain_ddp.controller.callbacks import ClusterRecount
from raytrain_ddp.data import datasets as data
from raytrain_ddp.driver import console as ui
from raytrain_ddp.driver import plan as planning
from raytrain_ddp.driver import prepare
from raytrain_ddp.driver.plan import Plan
from raytrain_ddp.driver.registration import Registration, decided_already, register_best
from raytrain_ddp.driver.summary import RunSummary, show
from raytrain_ddp.driver.timeline import Timeline, strip
from raytrain_ddp.errors import RunFailed, RunInterrupted
from raytrain_ddp.preflight import checks as preflight
from raytrain_ddp.ray_compat import controller, trainer
from raytrain_ddp.ray_compat.cluster import recounts
from raytrain_ddp.registry import endpoint, model_logging, tracking
from raytrain_ddp.worker.early_stopping import ended_early
from raytrain_ddp.worker.loop import train_loop_per_worker
from raytrain_ddp.worker.metrics import BAD_FILES


def run(
    config: Config,
    *,
    verbose: bool = False,
    console: Console | None = None,
    timeline: Timeline | None = None,
    reported: Callable[[dict[str, Any]], None] | None = None,
) -> RunSummary:
    """Train `config` to its last epoch (resuming the run if it exists), register the best
    checkpoint's model (as `mlflow.register` says: the summary says whether, and why), and return the
    summary. Raises ConfigError before any worker starts if the
    config, the recipe, the cluster, the storage, the tracking server or the run's record rule it
    out, RunBusy if another driver is training the run, RunFailed if training fails, and
    RegistrationFailed if training finished but the model could not be registered.

    A run that had already finished, with its model registered (or not, as `mlflow.register` decides
    without the model), is answered from its record without starting Ray: the summary of that run,
    with `already_finished` set (a finished run whose model is still to register is registered, as
    after training). `timeline`: where the run's phases are marked (the command line's, from its
    launch); else one from now. `reported`: called with each report's metrics as it reaches the driver
    (a sweep's trial passes them on to Ray Tune)."""
    started = time.monotonic()
    console = console or Console(soft_wrap=True)
    clock = timeline or Timeline(launched=time.time())
    with session.bounded_mlflow_retries():
        standing = planning.stand(config)
        if standing.finished and (decided := decided_already(standing)) is not None:
            summary = _already_finished(standing, decided, time.monotonic() - started)
            show(console, summary)
            return summary
        clock.mark("checks")
        plan = prepare.make(standing, verbose=verbose, console=console, clock=clock)
        flops = preflight.check(
            plan.config,
            plan.recipe,
            plan.datasets,
            example=plan.example,
            fitted=plan.fitted,
            train_rows=plan.train_rows,
            saved_config=plan.resume.saved_config,
        )
        plan = replace(plan, flops=flops)
        clock.mark("pre-flight")
        ui.show_plan(console, plan)
        with lease.Lease(plan.run_path), model_logging.Rehearsal() as rehearsal:
            run_id = tracking.start_run(plan.config, plan.run_path, plan.flops.params() | data.listed(plan.datasets))
            clock.mark("mlflow")
            trained = fit(plan, run_id, console, clock, rehearsal, verbose, reported)
            clock.mark("fit returned")
            if skipped := data.skipped(plan.datasets, trained.final_metrics.get(BAD_FILES, [])):
                tracking.log_skipped(plan.config, run_id, skipped)
            rehearsal.wait()  # torch.export keeps global state while it traces: one export at a time
            policy = plan.config.mlflow.register
            registration = register_best(plan, trained.best_checkpoints, run_id, console, policy)
            clock.mark("registered")
    summary = _summarize(plan, trained, registration, run_id, skipped, time.monotonic() - started)
    show(console, summary)
    _keep_timeline(plan, clock, console, verbose)
    return summary


def _keep_timeline(plan: Plan, kept: Timeline, console: Console, verbose: bool) -> None:
    """The run's timeline in `<run>/timeline.json` (the benchmark reads it); on the console, `verbose`."""
    if verbose:
        console.print(kept.table(), markup=False, highlight=False)
    try:
        storage.write_text(f"{plan.run_path}/timeline.json", kept.to_json())
    except OSError as e:  # a figure: never a reason to fail a run that trained
        console.print(f"[yellow]timeline not kept[/]: {e}", highlight=False)


@dataclass(frozen=True)
class Trained:
    epochs: int  # completed: all of them, or those before early stopping ended the run
    final_metrics: dict[str, Any]  # reported at the end of the last epoch (or evaluation)
    best_checkpoints: list[tuple[ray.train.Checkpoint, dict[str, Any]]]  # the committed ones, with their metrics
    failures: list[str]  # one line per failed attempt of the workers
    stopped_early: str | None = None  # why early stopping ended the run before train.epochs
    patience_spent: bool = False  # early stopping's patience is spent: more epochs alone train nothing


def fit(
    plan: Plan,
    run_id: str,
    console: Console,
    clock: Timeline,
    rehearsal: model_logging.Rehearsal,
    verbose: bool = False,
    reported: Callable[[dict[str, Any]], None] | None = None,
) -> Trained:
    """Train the plan's run to its last epoch (or until early stopping ends it), showing its progress.
    On the way out of a failure or Ctrl-C the MLflow run is marked FAILED or KILLED, and RunFailed or
    RunInterrupted says what failed, where the checkpoints are, the file with the workers' full
    tracebacks (printed too, `verbose`) and the command that resumes."""
    config = plan.config
    # Once the ranks train, the driver loads what registering the model will take, at the lowest
    # priority: not while Ray Train starts, which is the cores' work on a small machine.
    preparing = config.mlflow.register != "never" and plan.recipe.log_model is None
    metrics_log = tracking.MetricsLog(config.mlflow.tracking_uri, run_id)
    log = metrics_log.add if reported is None else lambda metrics: (metrics_log.add(metrics), reported(metrics))
    progress = ui.LiveProgress(console, plan, clock, log, rehearsal.start if preparing else None)
    try:
        with metrics_log:  # every report's metrics in MLflow before it ends
            result = _fit(plan, run_id, progress)
        if progress.stopped is not None:
            raise RunFailed(progress.stopped)
        metrics = result.metrics or {}
        epochs = int(metrics.get("epoch", 0))
        # Early stopping's reason: in the report that ended the run, or (a patience lowered on resume)
        # from its newest checkpoint's count, where the workers ended at once without a report.
        early = ended_early(metrics, config)
        if epochs < config.train.epochs and early is None:  # how an aborted fit() returns
            raise RunInterrupted(f"stopped after epoch {epochs} of {config.train.epochs}")
    except BaseException as e:
        # Ctrl-C reaches us as an aborted fit() (RunInterrupted), or through Ray's own SIGINT handler
        # as SystemExit or KeyboardInterrupt, depending on when it lands.
        # A SIGTERM (session.stop_on_sigterm) comes as Ctrl-C, or as the error of a Ray going down with it.
        stopped = isinstance(e, (KeyboardInterrupt, SystemExit, RunInterrupted)) or session.interrupted_by is not None
        interrupted = stopped and progress.gave_up is None
        tracking.end_failed_run(config, run_id, "KILLED" if interrupted else "FAILED")
        if interrupted:
            how = session.interrupted_by or (e if isinstance(e, RunInterrupted) else "Ctrl-C")
            what = f"was interrupted ({how})"
        elif progress.gave_up is not None:  # the driver ended it: its workers' resources never came
            what = f"failed: {progress.gave_up}"
        else:
            failed = ui.describe_failure(e, config.run.max_failures, len(progress.failures), progress.lost)
            what = f"failed: {failed}"
            what += _keep_tracebacks(plan, e, console if verbose else None)
        raise (RunInterrupted if interrupted else RunFailed)(
            f"run {config.run.name} {what}\n{_stands(plan)}\nresume: {plan.resume_command}"
        ) from e
    best = [(checkpoint, strip(metrics)) for checkpoint, metrics in result.best_checkpoints]
    stopped_early = early if epochs < config.train.epochs else None
    return Trained(epochs, strip(metrics), best, progress.failures, stopped_early, early is not None)


def _stands(plan: Plan) -> str:
    """Where a stopped run stands, for the line above its resume command: the checkpoint the command
    continues from (as a resume would choose it), or that nothing was saved and it starts over."""
    try:
        point = planning.resume_point(plan.run_path, plan.config)
    except Exception:  # noqa: BLE001 - every checkpoint damaged, or the storage failing: the resume will say
        return f"checkpoints so far: {plan.run_path}"
    if point.checkpoint is None:
        return f"nothing saved yet (no checkpoint in {plan.run_path}): the command below starts the run over"
    return (
        f"checkpoints so far: {plan.run_path}; the command below continues from {point.checkpoint} "
        f"(epoch {point.epoch:.4g}, step {point.step})"
    )


def _keep_tracebacks(plan: Plan, error: BaseException, console: Console | None) -> str:
    """The workers' full tracebacks (Ray Train's error carries them as text) in a file of the run,
    and on the console if given; returns the line that names the file."""
    if not isinstance(error, WorkerGroupError):
        return ""
    path = f"{plan.run_path}/errors/{time.strftime('%Y%m%d-%H%M%S')}.log"
    if console is not None:
        console.print(str(error), markup=False, highlight=False)
    try:
        storage.write_text(path, str(error))
    except OSError as e:  # the storage failing is likely why the run did: never hide the first error
        return f"\n(the workers' tracebacks could not be saved to {path}: {e})"
    return f"\nthe workers' full tracebacks: {path}" + ("" if console else " (or run with --verbose)")


def _fit(plan: Plan, run_id: str, progress: ui.LiveProgress) -> ray.train.Result:
    sigint, kept = signal.getsignal(signal.SIGINT), capacity.placement_groups()
    try:
        # The relay of the progress display exists once it has started; Ray Train reads its
        # settings from the driver's environment when fit() starts.
        settings = session.fit_environment(plan.config.run.controller_poll_s, plan.config.scaling.elastic)
        with progress, session.environment(settings):
            prestart.taken()
            result = _trainer(plan, run_id, progress).fit()
    except BaseException:
        capacity.release(kept, progress.placement_group)  # where a dead or killed controller left it
        raise
    finally:  # fit() installs a Ctrl-C handler of its own and leaves it behind
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, sigint)
    if result.error is not None:  # V2 raises instead; never let a failed fit pass as a result
        raise result.error
    return result


def _trainer(plan: Plan, run_id: str, progress: ui.LiveProgress) -> TorchTrainer:
    config, shipped = plan.config, data.shipped(plan.datasets)
    recount = [ClusterRecount(config.scaling.resize_check_s)] if config.scaling.elastic and recounts() else []
    loop_config = {
        "config": config.to_dict(),
        "recipe": plan.recipe,
        "fitted": plan.fitted,  # the statistics of the training rows that build_model takes
        "train_rows": plan.train_rows,  # each worker's share, on as many workers as the attempt has
        "example": plan.example,  # what the model generates from at each evaluation (generate_samples)
        "flops": plan.flops,  # what a training step costs: for model FLOP/s and MFU
        "shipped_datasets": shipped,  # torch Datasets, streams, a materialized Ray Dataset's blocks
        "progress": progress.queue,  # where rank 0 sends its live progress (run.progress_s)
    }
    return trainer.trainer_class()(
        # Bound to the loop, not passed as `train_loop_config`: Ray Train keeps that in the run's
        # context, which its controller unpickles before it starts a worker (importing the recipe's
        # modules: torch, transformers) and each worker a second time. The loop itself reaches the
        # workers alone, once, through the object store.
        functools.partial(train_loop_per_worker, loop_config),
        torch_config=trainer.torch_config(),  # Ray's TorchConfig, without torch on the controller where it can
        scaling_config=ScalingConfig(
            num_workers=config.scaling.num_workers,  # (min, max): elastic
            elastic_resize_monitor_interval_s=config.scaling.resize_check_s,
            use_gpu=config.scaling.use_gpu,
            resources_per_worker=dict(config.scaling.resources_per_worker),
            label_selector=dict(config.scaling.label_selector) or None,
        ),
        run_config=RunConfig(
            name=config.run.name,
            storage_path=config.run.storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=config.checkpoint.num_to_keep,
                checkpoint_score_attribute=config.checkpoint.score_attribute,
                checkpoint_score_order=config.checkpoint.score_order,
            ),
            failure_config=FailureConfig(max_failures=config.run.max_failures),
            worker_runtime_env=prestart.worker_runtime_env(config),  # what `prestart.start` matched
            callbacks=controller.callbacks([progress.relay], [progress.marks, *recount]),
        ),
        datasets=plan.datasets if shipped is None else None,  # lazy Ray Datasets: Ray Train's Ray Data path
        dataset_config=data.dataset_config(),
    )


def _already_finished(standing: planning.Standing, registration: Registration, wall_time_s: float) -> RunSummary:
    config, resume = standing.config, standing.resume
    return RunSummary(
        run_name=config.run.name,
        run_path=standing.run_path,
        epochs=int(resume.epoch),
        workers=config.scaling.max_workers,
        metrics=registration.metrics,
        final_metrics=resume.metrics,
        best_checkpoint=registration.checkpoint,
        model=registration.model,
        registration=registration.note,
        mlflow_run_id=tracking.find_run(config, standing.run_path),
        artifacts=[],
        tracking_uri=config.mlflow.tracking_uri,
        ui_command=endpoint.ui_command(config.mlflow.tracking_uri),
        extend_command=planning.resume_command(config, epochs="N"),
        wall_time_s=wall_time_s,
        resumed=resume,
        attempts=0,
        failures=[],
        already_finished=True,
        stopped_early=standing.stopped_early if resume.epoch < config.train.epochs else None,
        patience_spent=standing.stopped_early is not None,
    )


def _summarize(
    plan: Plan, trained: Trained, registration: Registration, run_id: str, skipped: list[str], wall_time_s: float
) -> RunSummary:
    config = plan.config
    return RunSummary(
        run_name=config.run.name,
        run_path=plan.run_path,
        epochs=trained.epochs,
        workers=config.scaling.max_workers,
        metrics=registration.metrics,
        final_metrics=trained.final_metrics,
        best_checkpoint=registration.checkpoint,
        model=registration.model,
        registration=registration.note,
        mlflow_run_id=run_id,
        artifacts=registration.artifacts,
        tracking_uri=config.mlflow.tracking_uri,
        ui_command=endpoint.ui_command(config.mlflow.tracking_uri),
        extend_command=plan.extend_command,
        wall_time_s=wall_time_s,
        resumed=plan.resume,
        attempts=1 + len(trained.failures),
        failures=trained.failures,
        stopped_early=trained.stopped_early,
        patience_spent=trained.patience_spent,
        skipped_files=skipped,
    )
