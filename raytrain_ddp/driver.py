"""`run(config) -> RunSummary`: one training run, from the CLI or a notebook.

    from raytrain_ddp import load_config, run
    summary = run(load_config("digits", overrides=["train.epochs=3"]))

Connects to Ray (an existing cluster via RAY_ADDRESS / `ray job submit`, else a local one), builds the
datasets with Ray Data, fits a TorchTrainer, then registers the best checkpoint's model in MLflow.
"""

from __future__ import annotations

import logging
import secrets
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
from raytrain_ddp.config import Config
from raytrain_ddp.loop import train_loop_per_worker


class RunFailed(RuntimeError):
    """Training did not finish; the message says why, where the checkpoints are and how to resume."""


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
    tracking_uri: str
    ui_command: str
    resume_command: str
    wall_time_s: float


def run(config: Config, *, verbose: bool = False, console: Console | None = None) -> RunSummary:
    """Train `config` to the end (or resume it), register the model, and return the summary."""
    started = time.monotonic()
    console = console or Console(soft_wrap=True)
    recipe = recipes.load(config.job)
    config = resolve(config, recipe.name)

    with console.status("Starting Ray…"):
        _connect(verbose)
    with console.status("Building datasets with Ray Data…"):
        datasets = data.check_datasets(recipe.build_datasets(seed=config.seed, **config.dataset), config.job)
        train_rows = datasets["train"].count()
        input_example = _input_example(recipe, datasets["val"])
    steps = data.steps_per_epoch(train_rows, config.scaling.num_workers, config.train.batch_size, config.train.drop_last)
    run_path = f"{config.run.storage_path}/{config.run.name}"
    console.print(
        f"[bold]{config.run.name}[/]: job {recipe.name}, {config.scaling.num_workers} workers × batch "
        f"{config.train.batch_size}, {train_rows} training rows ({steps} steps/epoch), checkpoints in {run_path}"
    )

    run_id = tracking.start_run(config)
    progress = ui.LiveProgress(
        console,
        epochs=config.train.epochs,
        score=config.checkpoint.score_attribute,
        order=config.checkpoint.score_order,
        workers=config.scaling.num_workers,
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": config.to_dict(), "recipe": recipe, "steps_per_epoch": steps},
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
        datasets=datasets,
        dataset_config=data.dataset_config(),
    )
    resume = f"raytrain-ddp train {config.job} run.name={config.run.name}"
    try:
        with progress:
            result = trainer.fit()
        if result.error is not None:
            raise result.error
        if result.checkpoint is None:
            raise RuntimeError("training reported no checkpoint")
    except BaseException as e:
        tracking.finish_run(config, run_id, failed=True)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RunFailed(f"run {config.run.name} failed: {e}\ncheckpoints so far: {run_path}\nresume: {resume}") from e

    with console.status("Registering the best checkpoint's model in MLflow…"):
        best = result.get_best_checkpoint(config.checkpoint.score_attribute, config.checkpoint.score_order)
        model = recipe.build_model(**config.model)
        with best.as_directory() as directory:
            model.load_state_dict(ckpt.load_model_state(directory))
            best_metrics = ckpt.load_metrics(directory)
        registered = tracking.register_model(config, run_id, model, input_example, best.path)
        tracking.finish_run(config, run_id, failed=False)

    summary = RunSummary(
        run_name=config.run.name,
        run_path=run_path,
        epochs=int(result.metrics["epoch"]) if result.metrics else best_metrics["epoch"],
        workers=config.scaling.num_workers,
        metrics=best_metrics,
        final_metrics=dict(result.metrics or best_metrics),
        best_checkpoint=best.path,
        model=registered,
        mlflow_run_id=run_id,
        tracking_uri=config.mlflow.tracking_uri,
        ui_command=tracking.ui_command(config.mlflow.tracking_uri),
        resume_command=f"{resume} train.epochs=<more than {config.train.epochs}>",
        wall_time_s=time.monotonic() - started,
    )
    ui.print_summary(console, summary)
    return summary


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


def _input_example(recipe: recipes.Recipe, val: ray.data.Dataset):
    """Two validation rows as the model sees them: the MLflow input example (batch > 1 keeps the
    exported model's batch dimension dynamic)."""
    batch = {k: torch.from_numpy(v.copy()) for k, v in val.take_batch(2, batch_format="numpy").items()}
    return recipe.model_input(batch).numpy()
