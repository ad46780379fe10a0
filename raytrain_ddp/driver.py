"""`run(config) -> RunSummary`: one training run, from the CLI or a notebook.

    from raytrain_ddp import load_config, run
    summary = run(load_config("digits", overrides=["train.epochs=3"]))

Connects to Ray (an existing cluster via RAY_ADDRESS / `ray job submit`, else a local one), builds the
datasets with Ray Data, fits a TorchTrainer, then registers the best checkpoint's model in MLflow.
"""

from __future__ import annotations

import logging
import secrets
import shlex
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.data
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from rich.console import Console

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp import console as ui
from raytrain_ddp import data, recipe as recipes, tracking
from raytrain_ddp.config import Config, ConfigError, load_config, resume_conflicts
from raytrain_ddp.loop import train_loop_per_worker
from raytrain_ddp.metrics import reported_metrics
from raytrain_ddp.optim import optimizer_steps


class RunFailed(RuntimeError):
    """Training did not finish; the message says why, where the checkpoints are and how to resume."""


class RunInterrupted(RunFailed):
    """Training was stopped (Ctrl-C, or the run was aborted) before its last epoch."""


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


def run(config: Config, *, verbose: bool = False, console: Console | None = None) -> RunSummary:
    """Train `config` to its last epoch (resuming the run if it exists), register the best
    checkpoint's model, and return the summary. Raises ConfigError before any worker starts if the
    recipe or a resumed run's record rules the config out, RunFailed if training fails."""
    started = time.monotonic()
    console = console or Console(soft_wrap=True)
    recipe = recipes.load(config.job)
    config = resolve(config, recipe.name)
    run_path = f"{config.run.storage_path}/{config.run.name}"

    with console.status("Starting Ray…"):
        _connect(verbose)
    with console.status("Building datasets…"):
        datasets = _build_datasets(config, recipe)
        train_rows = data.num_rows(datasets["train"])
        example = data.example_batch(datasets["val"])
    epochs_done = _check_before_training(config, recipe, example, run_path)
    t = config.train
    batches = data.batches_per_epoch(train_rows, config.scaling.num_workers, t.batch_size, t.drop_last)
    accumulation = f" × {t.grad_accum_steps} accumulated" if t.grad_accum_steps > 1 else ""
    resuming = f", resuming after epoch {epochs_done}" if epochs_done else ""
    console.print(
        f"[bold]{config.run.name}[/]: job {recipe.name}, {config.scaling.num_workers} workers × batch "
        f"{t.batch_size}{accumulation}, {train_rows} training rows "
        f"({optimizer_steps(batches, t.grad_accum_steps)} steps/epoch){resuming}, checkpoints in {run_path}"
    )

    run_id = tracking.start_run(config)
    resume = _resume_command(config, recipe.name)
    try:
        result = _fit(config, recipe, datasets, batches, run_id, console)
        epochs = int(result.metrics["epoch"]) if result.metrics else 0
        if epochs < config.train.epochs:  # how an aborted fit() returns: no error, fewer epochs
            raise RunInterrupted(f"stopped after epoch {epochs} of {config.train.epochs}")
        with console.status("Registering the best checkpoint's model in MLflow…"):
            best, best_metrics, registered, artifacts = _register_best(config, recipe, result, run_id, example)
    except BaseException as e:
        # Ctrl-C reaches us as an aborted fit() (RunInterrupted), or through Ray's own SIGINT handler
        # as SystemExit or KeyboardInterrupt, depending on when it lands.
        interrupted = isinstance(e, (KeyboardInterrupt, SystemExit, RunInterrupted))
        _finish_quietly(config, run_id, "KILLED" if interrupted else "FAILED")
        what = f"was interrupted ({e if isinstance(e, RunInterrupted) else 'Ctrl-C'})" if interrupted else f"failed: {e}"
        kind = RunInterrupted if interrupted else RunFailed
        raise kind(f"run {config.run.name} {what}\ncheckpoints so far: {run_path}\nresume: {resume}") from e
    tracking.finish_run(config, run_id, "FINISHED")

    summary = RunSummary(
        run_name=config.run.name,
        run_path=run_path,
        epochs=epochs,
        workers=config.scaling.num_workers,
        metrics=best_metrics,
        final_metrics=dict(result.metrics),
        best_checkpoint=best.path,
        model=registered,
        mlflow_run_id=run_id,
        artifacts=sorted(artifacts),
        tracking_uri=config.mlflow.tracking_uri,
        ui_command=tracking.ui_command(config.mlflow.tracking_uri),
        extend_command=_resume_command(config, recipe.name, epochs="N"),
        wall_time_s=time.monotonic() - started,
    )
    ui.print_summary(console, summary)
    return summary


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


def _check_before_training(config: Config, recipe: recipes.Recipe, example: dict, run_path: str) -> int:
    """What needs the recipe or the run's record, checked before any worker starts: the recipe runs on
    two validation rows, the score metric is one the loop reports, and a resumed run changes nothing
    it must keep. Returns the epochs the run has already trained (0 for a new run)."""
    problems = []
    try:
        model = recipe.build_model(**config.model).eval()
        with torch.no_grad():
            loss = recipe.compute_loss(model, example)
            val_names = recipe.evaluate(model, example).keys()
    except Exception as e:  # noqa: BLE001 - the recipe's own message says what is wrong
        raise ConfigError(config.job, [f"recipe {recipe.name} fails on two validation rows: {type(e).__name__}: {e}"]) from e
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
        problems.append(f"recipe {recipe.name}: compute_loss must return a scalar tensor, got {loss!r:.80}")
    reported = reported_metrics(val_names, counts_tokens=recipe.count_tokens is not None)
    if config.checkpoint.score_attribute not in reported:
        problems.append(
            f"checkpoint.score_attribute: {config.checkpoint.score_attribute!r} is not a reported metric; "
            f"choose one of: {', '.join(sorted(reported))}"
        )
    latest = _latest_checkpoint(run_path)
    if latest is not None:
        with latest.as_directory() as directory:
            saved = ckpt.open_verified(directory)
            conflicts = resume_conflicts(saved.config(), config)
            epochs_done = saved.metrics()["epoch"]
        problems += [f"{c} (resuming {run_path}; or start a new run: run.name=null)" for c in conflicts]
    if problems:
        raise ConfigError(config.job, problems)
    return epochs_done if latest is not None else 0


def _latest_checkpoint(run_path: str) -> ray.train.Checkpoint | None:
    """The checkpoint Ray will resume from, read from Ray's own record of the run; None if the run has
    none yet."""
    try:
        return ray.train.Result.from_path(run_path).checkpoint
    except RuntimeError:  # no run directory, or no checkpoint committed in it
        return None


def _fit(config: Config, recipe: recipes.Recipe, datasets: dict, batches: int, run_id: str, console: Console):
    ray_data = data.is_ray(datasets)
    progress = ui.LiveProgress(
        console,
        epochs=config.train.epochs,
        score=config.checkpoint.score_attribute,
        order=config.checkpoint.score_order,
        workers=config.scaling.num_workers,
    )
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
            callbacks=[tracking.MLflowMetrics(config.mlflow.tracking_uri, run_id), progress.relay],
        ),
        datasets=datasets if ray_data else None,
        dataset_config=data.dataset_config(),
    )
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with progress:
            result = trainer.fit()
    finally:  # fit() installs a Ctrl-C handler of its own and leaves it behind
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, sigint)
    if result.error is not None:  # V2 raises instead; never let a failed fit pass as a result
        raise result.error
    return result


def _register_best(config: Config, recipe: recipes.Recipe, result, run_id: str, example: dict):
    best = result.get_best_checkpoint(config.checkpoint.score_attribute, config.checkpoint.score_order)
    model = recipe.build_model(**config.model)
    with best.as_directory() as directory:
        saved = ckpt.open_verified(directory)
        model.load_state_dict(saved.model_state())
        metrics = saved.metrics()
    # Two rows, so the exported model keeps a dynamic batch dimension.
    input_example = recipe.model_input(example).numpy()
    registered = tracking.register_model(config, run_id, model, input_example, best.path)
    artifacts = {}
    if recipe.artifacts is not None:
        with torch.no_grad():
            artifacts = recipe.artifacts(model.eval())
        tracking.log_texts(config, run_id, artifacts)
    return best, metrics, registered, artifacts


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
    context.enable_progress_bars = verbose
    context.print_on_execution_start = verbose
    for noisy in ("ray.data", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.ERROR)
