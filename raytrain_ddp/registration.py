"""Registering a run's model: the best of its checkpoints that verifies, logged to MLflow with an input
example and registered as a new version of `mlflow.model_name`. `driver.run` does it when training
finishes; `register(run_path)` does it later, for a run whose driver could not (the tracking server
was down, say). Both go through `register_best`.

    raytrain-ddp register runs/<name>
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
import ray.train
import torch
from rich.console import Console
from rich.markup import escape

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp import lease, session, tracking
from raytrain_ddp import plan as planning
from raytrain_ddp.config import Config
from raytrain_ddp.console import one_line
from raytrain_ddp.errors import RegistrationFailed
from raytrain_ddp.plan import Plan
from raytrain_ddp.recipe import Recipe


@dataclass(frozen=True)
class Registration:
    checkpoint: str  # where the registered checkpoint is: a path, or a URI
    metrics: dict[str, Any]  # reported with it
    model: tracking.RegisteredModel
    artifacts: list[str]  # the recipe's text artifacts, logged beside the model


def register(
    run_path: str, *, tracking_uri: str | None = None, verbose: bool = False, console: Console | None = None
) -> tracking.RegisteredModel:
    """Register the best checkpoint of a run that finished training but whose model was not
    registered, with the config saved in its checkpoints, into `tracking_uri` (default: the one the
    run used). Idempotent: a version this run already registered for that checkpoint is returned, not
    duplicated."""
    console = console or Console(soft_wrap=True)
    with session.bounded_mlflow_retries():
        standing = planning.stand(planning.finished_config(run_path, tracking_uri))
        plan = planning.make(standing, verbose=verbose, console=console)
        with lease.Lease(plan.run_path):
            run_id = tracking.start_run(plan.config, plan.run_path)
            registration = register_best(plan, ckpt.run_record(plan.run_path).best_checkpoints, run_id, console)
    model, config = registration.model, plan.config
    console.print(
        f"{config.run.name}: {registration.checkpoint} is [bold]{model.name}[/] version {model.version} ({model.uri}); "
        f"MLflow run {run_id} in {config.mlflow.tracking_uri}"
    )
    return model


def register_best(
    plan: Plan, checkpoints: Iterable[tuple[ray.train.Checkpoint, dict[str, Any]]], run_id: str, console: Console
) -> Registration:
    """Register the best of the run's (checkpoint, metrics) that verifies, saying which better ones
    were damaged, and mark the MLflow run FINISHED. Raises RegistrationFailed, with the command that
    registers later, if MLflow fails on the way (the MLflow run is then marked FAILED)."""
    config = plan.config
    try:
        with console.status("Registering the best checkpoint's model in MLflow…"):
            registration = _register(plan, checkpoints, run_id, console)
        tracking.finish_run(config, run_id, "FINISHED")
    except Exception as e:
        tracking.end_failed_run(config, run_id, "FAILED")
        raise RegistrationFailed(
            f"run {config.run.name} finished training ({config.train.epochs} epochs), but its model was not "
            f"registered: {one_line(e)}\ncheckpoints: {plan.run_path}\n"
            f"register it later: {shlex.join(['raytrain-ddp', 'register', plan.run_path])}"
        ) from e
    return registration


def registered_already(standing: planning.Standing) -> Registration | None:
    """For a finished run, the model version its MLflow run registered for its best checkpoint that
    verifies (the one `register_best` registers), read without Ray; None if there is none."""
    config = standing.config
    run_id = tracking.find_run(config, standing.run_path)
    record = ckpt.run_record(standing.run_path)
    if run_id is None or record is None:
        return None
    with ckpt.open_first_verified(_ranked(config, record.best_checkpoints)) as best:
        if (model := tracking.registered_version(config, run_id, best.location)) is None:
            return None
        return Registration(best.location, best.verified.metrics(), model, [])


def _ranked(config: Config, checkpoints: Iterable) -> list[ray.train.Checkpoint]:
    """(checkpoint, metrics) pairs, best first by the score metric."""
    score, order = config.checkpoint.score_attribute, config.checkpoint.score_order
    return [checkpoint for checkpoint, _ in sorted(checkpoints, key=lambda cm: cm[1][score], reverse=order == "max")]


def _register(plan: Plan, checkpoints: Iterable, run_id: str, console: Console) -> Registration:
    config = plan.config
    ranked = _ranked(config, checkpoints)
    if plan.recipe.holds_large_model:  # where the memory is: a task with a training worker's resources
        s = config.scaling
        task = ray.remote(register_checkpoint).options(
            num_cpus=s.resources_per_worker.get("CPU", 1.0), num_gpus=1 if s.use_gpu else 0, max_retries=0
        )
        registration, skipped = ray.get(task.remote(config, plan.recipe, ranked, plan.example, run_id))
    else:
        registration, skipped = register_checkpoint(config, plan.recipe, ranked, plan.example, run_id)
    for damaged in skipped:
        console.print(f"[yellow]skipped damaged checkpoint[/] {escape(str(damaged))}")
    return registration


def register_checkpoint(
    config: Config,
    recipe: Recipe,
    ranked: list[ray.train.Checkpoint],
    example: dict[str, torch.Tensor],
    run_id: str,
) -> tuple[Registration, list[ckpt.Skipped]]:
    """Build the model, load the first of `ranked` that verifies, log it (the recipe's log_model, else
    as a PyTorch model with `example` as its input example) with the recipe's artifacts, and register
    it. Returns the registration and the better checkpoints skipped as damaged. A checkpoint this run
    registered already is returned as it is, without building the model."""
    with ckpt.open_first_verified(ranked) as best:
        metrics = best.verified.metrics()
        if (registered := tracking.registered_version(config, run_id, best.location)) is not None:
            return Registration(best.location, metrics, registered, []), best.skipped
        model = recipe.make_model(config)
        ckpt.load_weights(model, best.verified.model_state())
    model.eval()
    if recipe.log_model is not None:
        log = partial(recipe.log_model, model)
    else:  # two rows, so the exported model keeps a dynamic batch dimension
        log = partial(tracking.log_pytorch_model, model, recipe.model_input(example).numpy())
    registered = tracking.register_model(config, run_id, best.location, log)
    artifacts = {}
    if recipe.artifacts is not None:
        with torch.no_grad():
            artifacts = recipe.artifacts(model)
        tracking.log_texts(config, run_id, artifacts)
    return Registration(best.location, metrics, registered, sorted(artifacts)), best.skipped
