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
from typing import Any

import ray.train
import torch
from rich.console import Console
from rich.markup import escape

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp import lease, session, tracking
from raytrain_ddp import plan as planning
from raytrain_ddp.console import one_line
from raytrain_ddp.errors import RegistrationFailed
from raytrain_ddp.plan import Plan


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
        plan = planning.make(planning.finished_config(run_path, tracking_uri), verbose=verbose, console=console)
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


def _register(plan: Plan, checkpoints: Iterable, run_id: str, console: Console) -> Registration:
    config, recipe = plan.config, plan.recipe
    score, order = config.checkpoint.score_attribute, config.checkpoint.score_order
    ranked = sorted(checkpoints, key=lambda cm: cm[1][score], reverse=order == "max")
    model = recipe.build_model(**config.model)
    with ckpt.open_first_verified(checkpoint for checkpoint, _ in ranked) as best:
        for skipped in best.skipped:
            console.print(f"[yellow]skipped damaged checkpoint[/] {escape(str(skipped))}")
        model.load_state_dict(best.verified.model_state())
        metrics = best.verified.metrics()
    # Two rows, so the exported model keeps a dynamic batch dimension.
    input_example = recipe.model_input(plan.example).numpy()
    registered = tracking.register_model(config, run_id, model, input_example, best.location)
    artifacts = {}
    if recipe.artifacts is not None:
        with torch.no_grad():
            artifacts = recipe.artifacts(model.eval())
        tracking.log_texts(config, run_id, artifacts)
    return Registration(best.location, metrics, registered, sorted(artifacts))
