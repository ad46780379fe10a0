"""`run(config) -> RunSummary`: one training run, from the CLI or a notebook.

    from raytrain_ddp import load_config, run
    summary = run(load_config("digits", overrides=["train.epochs=3"]))

Connects to Ray (an existing cluster via RAY_ADDRESS / `ray job submit`, else a local one), builds the
datasets with Ray Data, fits a TorchTrainer, then registers the best checkpoint's model in MLflow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shlex
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.data
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, WorkerGroupError
from ray.train.torch import TorchTrainer
from rich.console import Console
from rich.markup import escape

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp import console as ui
from raytrain_ddp import data, lease, preflight, storage, tracking
from raytrain_ddp import recipe as recipes
from raytrain_ddp.config import Config, ConfigError, load_config
from raytrain_ddp.loop import train_loop_per_worker
from raytrain_ddp.optim import optimizer_steps

CONTROLLER_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


class RunFailed(RuntimeError):
    """Training did not finish; the message says why, where the checkpoints are and how to resume."""


class RunInterrupted(RunFailed):
    """Training was stopped (Ctrl-C, or the run was aborted) before its last epoch."""


class RegistrationFailed(RunFailed):
    """Training finished and its checkpoints are safe, but the model could not be registered (the
    tracking server went away, say); `raytrain-ddp register <run>` finishes the job later."""


@dataclass(frozen=True)
class RunSummary:
    run_name: str
    run_path: str  # <storage_path>/<run name>: the checkpoints
    epochs: int  # epochs completed
    workers: int
    metrics: dict[str, Any]  # reported with the best checkpoint: the registered model's
    final_metrics: dict[str, Any]  # of the last epoch
    best_checkpoint: str
    model: tracking.RegisteredModel
    mlflow_run_id: str
    artifacts: list[str]  # the recipe's text artifacts in the MLflow run
    tracking_uri: str
    ui_command: str
    extend_command: str  # resumes the run with train.epochs=N: train it longer
    wall_time_s: float
    resumed: preflight.Resume  # where this driver found the run: a new run, or its checkpoint
    attempts: int  # 1 + restarts of the workers after failures
    failures: list[str]  # one line per failed attempt: which rank failed, how, and where it restarted


def run(config: Config, *, verbose: bool = False, console: Console | None = None) -> RunSummary:
    """Train `config` to its last epoch (resuming the run if it exists), register the best
    checkpoint's model, and return the summary. Raises ConfigError before any worker starts if the
    config, the recipe, the cluster, the storage, the tracking server or the run's record rule it
    out, RunBusy if another driver is training the run, RunFailed if training fails, and
    RegistrationFailed if training finished but the model could not be registered."""
    with _bounded_mlflow_retries():
        return _run(config, verbose, console or Console(soft_wrap=True))


def _run(config: Config, verbose: bool, console: Console) -> RunSummary:
    started = time.monotonic()
    recipe = recipes.load(config.job)
    config = resolve(config, recipe.name)
    run_path = f"{config.run.storage_path}/{config.run.name}"
    lease.check(run_path)  # another driver training this run: refused before anything is read or written
    # Seconds, before Ray starts: where the run would be lost, a tracking server that cannot be reached.
    server = tracking.check_server(config.mlflow.tracking_uri)
    if problems := preflight.check_lasting_paths(config) + ([server] if server else []):
        raise ConfigError(config.job, problems)

    store = threading.Thread(target=tracking.open_store, args=(config.mlflow.tracking_uri,), daemon=True)
    store.start()  # meanwhile: opening the MLflow store takes seconds
    with console.status("Starting Ray…"):
        _connect(verbose)
    with console.status("Building datasets…"):
        datasets = _build_datasets(config, recipe)
        train_rows = data.num_rows(datasets["train"])
        example = data.example_batch(datasets["val"])
    resume = _check_before_training(config, recipe, datasets, example, run_path)
    t = config.train
    batches = data.batches_per_epoch(train_rows, config.scaling.num_workers, t.batch_size, t.drop_last)
    accumulation = f" × {t.grad_accum_steps} accumulated" if t.grad_accum_steps > 1 else ""
    resuming = (
        f", resuming from {resume.checkpoint} (epoch {resume.epoch:.4g}, step {resume.step})"
        if resume.checkpoint
        else ""
    )
    console.print(
        f"[bold]{config.run.name}[/]: job {recipe.name}, {config.scaling.num_workers} workers × batch "
        f"{t.batch_size}{accumulation}, {train_rows} training rows "
        f"({optimizer_steps(batches, t.grad_accum_steps)} steps/epoch){resuming}, checkpoints in {run_path}"
    )
    for skipped in resume.skipped:
        console.print(f"[yellow]skipped damaged checkpoint[/] {escape(str(skipped))}")

    resume_command = _resume_command(config, recipe.name)
    progress = ui.LiveProgress(
        console,
        epochs=config.train.epochs,
        score=config.checkpoint.score_attribute,
        order=config.checkpoint.score_order,
        workers=config.scaling.num_workers,
        max_failures=config.run.max_failures,
        latest=resume.checkpoint,
    )
    with lease.Lease(run_path):
        store.join()
        run_id = tracking.start_run(config)
        try:
            result = _fit(config, recipe, datasets, batches, run_id, progress)
            if progress.stopped is not None:
                raise RunFailed(progress.stopped)
            epochs = int(result.metrics["epoch"]) if result.metrics else 0
            if epochs < config.train.epochs:  # how an aborted fit() returns: no error, fewer epochs
                raise RunInterrupted(f"stopped after epoch {epochs} of {config.train.epochs}")
        except BaseException as e:
            # Ctrl-C reaches us as an aborted fit() (RunInterrupted), or through Ray's own SIGINT handler
            # as SystemExit or KeyboardInterrupt, depending on when it lands.
            interrupted = isinstance(e, (KeyboardInterrupt, SystemExit, RunInterrupted))
            _finish_quietly(config, run_id, "KILLED" if interrupted else "FAILED")
            what = (
                f"was interrupted ({e if isinstance(e, RunInterrupted) else 'Ctrl-C'})"
                if interrupted
                else f"failed: {_describe_failure(e, config, progress)}"
            )
            kind = RunInterrupted if interrupted else RunFailed
            raise kind(f"run {config.run.name} {what}\ncheckpoints so far: {run_path}\nresume: {resume_command}") from e
        try:
            with console.status("Registering the best checkpoint's model in MLflow…"):
                best_checkpoint, best_metrics, registered, artifacts = _register_best(
                    config, recipe, result.best_checkpoints, run_id, example, console
                )
            tracking.finish_run(config, run_id, "FINISHED")
        except Exception as e:
            _finish_quietly(config, run_id, "FAILED")
            raise RegistrationFailed(
                f"run {config.run.name} finished training ({epochs} epochs), but its model was not registered: "
                f"{ui.one_line(e)}\ncheckpoints: {run_path}\n"
                f"register it later: {shlex.join(['raytrain-ddp', 'register', run_path])}"
            ) from e

    summary = RunSummary(
        run_name=config.run.name,
        run_path=run_path,
        epochs=epochs,
        workers=config.scaling.num_workers,
        metrics=best_metrics,
        final_metrics=dict(result.metrics),
        best_checkpoint=best_checkpoint,
        model=registered,
        mlflow_run_id=run_id,
        artifacts=sorted(artifacts),
        tracking_uri=config.mlflow.tracking_uri,
        ui_command=tracking.ui_command(config.mlflow.tracking_uri),
        extend_command=_resume_command(config, recipe.name, epochs="N"),
        wall_time_s=time.monotonic() - started,
        resumed=resume,
        attempts=1 + len(progress.failures),
        failures=progress.failures,
    )
    ui.print_summary(console, summary)
    return summary


def register(
    run_path: str, *, tracking_uri: str | None = None, verbose: bool = False, console: Console | None = None
) -> tracking.RegisteredModel:
    """Register the best checkpoint of a run that finished training but whose model was not
    registered (the tracking server was down, say), with the config saved in its checkpoints, into
    `tracking_uri` (default: the one the run used). Idempotent: a version this run already
    registered for that checkpoint is returned, not duplicated."""
    console = console or Console(soft_wrap=True)
    run_path = run_path.rstrip("/") if "://" in run_path else str(Path(run_path).expanduser().resolve())
    storage_path, name = run_path.rsplit("/", 1)
    with _bounded_mlflow_retries():
        lease.check(run_path)
        try:
            checkpoints = ray.train.Result.from_path(run_path).best_checkpoints
        except RuntimeError:
            checkpoints = []
        if not checkpoints:
            raise ConfigError(name, [f"{run_path}: no committed checkpoint there; give the directory of a run"])
        with ckpt.open_first_verified(ckpt.newest_first(checkpoints)) as latest:
            saved = Config.from_dict(latest.verified.config())
            epoch = latest.verified.metrics()["epoch"]
        config = saved.model_copy(
            update={
                "run": saved.run.model_copy(update={"storage_path": storage_path, "name": name}),
                "mlflow": saved.mlflow.model_copy(
                    update={"tracking_uri": tracking.resolve_tracking_uri(tracking_uri or saved.mlflow.tracking_uri)}
                ),
            }
        )
        recipe = recipes.load(config.job)
        if epoch < config.train.epochs:
            raise ConfigError(
                config.job,
                [
                    f"run {name} has not finished training (epoch {epoch:g} of {config.train.epochs}); "
                    f"resume it: {_resume_command(config, recipe.name)}"
                ],
            )
        if problem := tracking.check_server(config.mlflow.tracking_uri):
            raise ConfigError(config.job, [problem])
        with console.status("Reading two validation rows for the model's input example…"):
            _connect(verbose)
            example = data.example_batch(_build_datasets(config, recipe)["val"])
        with lease.Lease(run_path), console.status("Registering the best checkpoint's model in MLflow…"):
            run_id = tracking.start_run(config)
            best_checkpoint, _, registered, _ = _register_best(config, recipe, checkpoints, run_id, example, console)
            tracking.finish_run(config, run_id, "FINISHED")
    console.print(
        f"{name}: {best_checkpoint} is [bold]{registered.name}[/] version {registered.version} ({registered.uri}); "
        f"MLflow run {run_id} in {config.mlflow.tracking_uri}"
    )
    return registered


def _resume_command(config: Config, job_name: str, *, epochs: str | None = None) -> str:
    """The command that continues this run: its name, and every setting that differs from the job's
    own YAML (a resumed run must keep them), resolved as from the current directory; `epochs`, if
    given, replaces train.epochs."""
    base = resolve(load_config(config.job).with_overrides(f"run.name={config.run.name}"), job_name)
    overrides = config.overrides_against(base)
    if epochs is not None:
        overrides = [o for o in overrides if not o.startswith("train.epochs=")] + [f"train.epochs={epochs}"]
    return shlex.join(["raytrain-ddp", "train", config.job, f"run.name={config.run.name}", *overrides])


def _build_datasets(config: Config, recipe: recipes.Recipe) -> dict:
    """The recipe's datasets; a recipe that cannot build them (a missing file, say) is a config problem:
    reported like one, before anything is started or written."""
    try:
        datasets = recipe.build_datasets(seed=config.seed, **config.dataset)
    except Exception as e:  # noqa: BLE001 - whatever the recipe raises, with its own message
        raise ConfigError(config.job, [f"recipe {recipe.name}: build_datasets failed: {type(e).__name__}: {e}"]) from e
    try:
        return data.check_datasets(datasets, config.job)
    except TypeError as e:
        raise ConfigError(config.job, [str(e)]) from None


def _check_before_training(
    config: Config, recipe: recipes.Recipe, datasets: dict, example: dict, run_path: str
) -> preflight.Resume:
    """Everything that can rule the run out without starting a worker (see preflight.py), reported
    at once as a ConfigError; a run whose checkpoints are all damaged is a RunFailed. Returns where
    the run stands."""
    problems = (
        preflight.check_recipe(config, recipe, example)
        + preflight.check_resources(config, datasets)
        + storage.check_shared(config.run.storage_path)
    )
    try:
        resume, conflicts = preflight.check_resume(config, run_path)
    except ckpt.NoValidCheckpoint as e:
        raise RunFailed(
            f"run {config.run.name} cannot resume: {e}\nrestore the files, or start a new run (run.name=null)"
        ) from None
    if problems + conflicts:
        raise ConfigError(config.job, problems + conflicts)
    return resume


def _fit(
    config: Config, recipe: recipes.Recipe, datasets: dict, batches: int, run_id: str, progress: ui.LiveProgress
) -> ray.train.Result:
    ray_data = data.is_ray(datasets)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with progress:
            trainer = TorchTrainer(
                train_loop_per_worker,
                train_loop_config={
                    "config": config.to_dict(),
                    "recipe": recipe,
                    "batches_per_epoch": batches,
                    "torch_datasets": None if ray_data else datasets,  # shipped to every worker with the loop
                },
                scaling_config=ScalingConfig(
                    num_workers=config.scaling.num_workers,
                    use_gpu=config.scaling.use_gpu,
                    resources_per_worker=dict(config.scaling.resources_per_worker),
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
                    callbacks=[
                        tracking.MLflowMetrics(config.mlflow.tracking_uri, run_id, config.train.epochs),
                        progress.relay,
                    ],
                ),
                datasets=datasets if ray_data else None,
                dataset_config=data.dataset_config(),
            )
            # Ray Train reads the controller's poll interval from the driver's environment at fit().
            with _environment({CONTROLLER_POLL_ENV: str(config.run.controller_poll_s)}):
                result = trainer.fit()
    finally:  # fit() installs a Ctrl-C handler of its own and leaves it behind
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, sigint)
    if result.error is not None:  # V2 raises instead; never let a failed fit pass as a result
        raise result.error
    return result


def _bounded_mlflow_retries() -> contextlib.AbstractContextManager:
    """MLflow's HTTP retries bounded (tracking.BOUNDED_RETRIES), unless the environment sets them."""
    return _environment({key: os.environ.get(key, value) for key, value in tracking.BOUNDED_RETRIES.items()})


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the call, then put back the caller's (a notebook's, say)."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _register_best(
    config: Config, recipe: recipes.Recipe, checkpoints: list, run_id: str, example: dict, console: Console
):
    """Register the best of the run's (checkpoint, metrics) that verifies (saying which better ones
    were damaged). Returns where it is, its metrics, the registered version and the recipe's texts."""
    score, order = config.checkpoint.score_attribute, config.checkpoint.score_order
    ranked = sorted(checkpoints, key=lambda cm: cm[1][score], reverse=order == "max")
    model = recipe.build_model(**config.model)
    with ckpt.open_first_verified(checkpoint for checkpoint, _ in ranked) as best:
        for skipped in best.skipped:
            console.print(f"[yellow]skipped damaged checkpoint[/] {escape(str(skipped))}")
        model.load_state_dict(best.verified.model_state())
        metrics = best.verified.metrics()
    # Two rows, so the exported model keeps a dynamic batch dimension.
    input_example = recipe.model_input(example).numpy()
    registered = tracking.register_model(config, run_id, model, input_example, best.location)
    artifacts = {}
    if recipe.artifacts is not None:
        with torch.no_grad():
            artifacts = recipe.artifacts(model.eval())
        tracking.log_texts(config, run_id, artifacts)
    return best.location, metrics, registered, artifacts


def _describe_failure(error: BaseException, config: Config, progress: ui.LiveProgress) -> str:
    """What failed, on which rank, after how many attempts: one line per rank, not Ray's tracebacks."""
    if isinstance(error, WorkerGroupError):
        attempts = max(len(progress.failures), 1)
        ranks = "; ".join(f"rank {rank}: {ui.one_line(e)}" for rank, e in sorted(error.worker_failures.items()))
        return f"{ranks} (attempt {attempts}; run.max_failures={config.run.max_failures})"
    return str(error)


def _finish_quietly(config: Config, run_id: str, status: str) -> None:
    """Mark the MLflow run ended on the way out of a failure, without hiding that failure."""
    try:
        tracking.finish_run(config, run_id, status)
    except Exception as e:  # noqa: BLE001
        logging.getLogger(__name__).warning("could not mark MLflow run %s %s: %s", run_id, status, e)


def resolve(config: Config, job_name: str) -> Config:
    """Fill what defaults to 'decide at run time': run name, absolute paths, MLflow names."""
    run_name = config.run.name or f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    storage = config.run.storage_path
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    return config.model_copy(
        update={
            "run": config.run.model_copy(update={"name": run_name, "storage_path": storage}),
            "mlflow": config.mlflow.model_copy(
                update={
                    "tracking_uri": tracking.resolve_tracking_uri(config.mlflow.tracking_uri),
                    "experiment": config.mlflow.experiment or job_name,
                    "model_name": config.mlflow.model_name or job_name,
                }
            ),
        }
    )


def _connect(verbose: bool) -> None:
    """Join the cluster named by RAY_ADDRESS (as `ray job submit` sets it), else start a local Ray."""
    if not ray.is_initialized():
        ray.init(log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR)
    context = ray.data.DataContext.get_current()
    # A recipe's datasets in the same row order every time: without it, a materialized map_batches
    # lists its blocks in the order its tasks finished, and the data order would not be a function
    # of the seed (exact resume and reproducible runs depend on it).
    context.execution_options.preserve_order = True
    context.enable_progress_bars = verbose
    context.print_on_execution_start = verbose
    for noisy in ("ray.data", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.ERROR)
