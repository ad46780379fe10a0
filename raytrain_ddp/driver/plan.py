"""A run's plan: everything decided before training, resolved once from the loaded config and then
read by the rest of the run (the checks, the trainer, registration and the summary).

    stand(config):  names and paths: run name, <storage_path>/<name>, tracking URI, MLflow names
                    -> what can be refused before Ray starts (preflight.check_before_ray)
                    -> where the run stands (its newest verified checkpoint), what a resume may not change
    then prepare.py's `make(standing)`: Ray joined, the recipe's datasets built, two validation rows:
                    the Plan, with the commands that resume the run and train it longer
    (then preflight.check adds what a training step costs: `flops`)

Values only: the functions here read the config and the run's record, and start nothing.

A finished run is known from its `Standing`, before Ray starts (`Standing.finished`).
"""

from __future__ import annotations

import secrets
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.checkpoint import storage
from raytrain_ddp.cluster import ray_address
from raytrain_ddp.config import layering
from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config, ConfigError
from raytrain_ddp.errors import RunFailed
from raytrain_ddp.preflight import checks as preflight
from raytrain_ddp.preflight.recipe_check import where
from raytrain_ddp.preflight.resume import resume_conflicts
from raytrain_ddp.registry import endpoint
from raytrain_ddp.worker.early_stopping import ended_early
from raytrain_ddp.worker.flops import ModelFlops
from raytrain_ddp.worker.optim import Accumulation


@dataclass(frozen=True)
class ResumePoint:
    """Where a run stands: the checkpoint training continues from (None for a new run)."""

    checkpoint: str | None = None  # its name in the run directory
    epoch: float = 0.0  # epochs trained, a fraction mid-epoch
    step: int = 0
    skipped: list[str] = field(default_factory=list)  # newer checkpoints that failed verification, and why
    saved_config: dict[str, Any] | None = None  # the config it was written with
    best: dict[str, Any] | None = None  # metrics of the run's best checkpoint so far (checkpoint.best_first)
    metrics: dict[str, Any] = field(default_factory=dict)  # reported with it


@dataclass(frozen=True)
class Standing:
    """A run before Ray starts: its resolved config, directory and resume point, and the Ray to join."""

    config: Config  # resolved: run name, absolute storage path and tracking URI, MLflow names
    run_path: str  # <storage_path>/<run name>
    resume: ResumePoint
    address: ray_address.RayAddress
    named: bool  # run.name was given (not made up for a new run)
    derived: dict[str, Any] = field(default_factory=dict)  # the settings the data decided (derive_settings)

    @property
    def finished(self) -> bool:
        """Trained to train.epochs already (its newest checkpoint that verifies is the last epoch's),
        or ended by its early stopping (`stopped_early` says why)."""
        return self.resume.checkpoint is not None and (
            self.resume.epoch >= self.config.train.epochs or self.stopped_early is not None
        )

    @property
    def stopped_early(self) -> str | None:
        return None if self.resume.checkpoint is None else ended_early(self.resume.metrics, self.config)


@dataclass(frozen=True)
class Plan:
    """A run, decided: what the checks, the trainer, registration and the summary all read."""

    config: Config  # resolved: run name, absolute storage path and tracking URI, MLflow names
    recipe: Recipe
    run_path: str  # <storage_path>/<run name>: the run's checkpoints, Ray's record of them, the lease
    datasets: dict[str, Any]  # the recipe's {"train", "val"}: Ray Datasets or torch Datasets
    fitted: Any  # what build_datasets fitted on the training rows, for build_model (None: nothing)
    train_rows: int
    example: dict[str, torch.Tensor]  # two validation rows: the pre-flight input and the model's input example
    resume: ResumePoint
    resume_command: str  # continues this run
    extend_command: str  # continues it with train.epochs=N: trains it longer
    named: bool = True  # run.name was given (not made up for a new run)
    derived: dict[str, Any] = field(default_factory=dict)  # the settings the data decided (derive_settings)
    flops: ModelFlops = ModelFlops()  # what a training step costs: found by the pre-flight check (flops.py)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps an epoch: the same on every number of workers (the global batch stays)."""
        return Accumulation.on(self.config, self.train_rows, self.config.scaling.max_workers).steps


def stand(config: Config) -> Standing:
    """Where a run of `config` stands, decided before Ray starts. Raises RunBusy, ConfigError (a
    RAY_ADDRESS, tracking server or path that cannot be used; a resume that changes what it may not),
    or RunFailed for a run whose checkpoints are all damaged."""
    named = config.run.name is not None
    config = resolve(config, layering.origin_of(config).job.name)
    run_path = config.run.path
    address = preflight.check_before_ray(config, run_path)
    config, derived = from_the_data(config)
    resume = resume_point(run_path, config)
    if resume.saved_config is not None and (conflicts := resume_conflicts(resume.saved_config, config)):
        raise ConfigError(
            config.job, [f"{c} (resuming {run_path}; or start a new run: run.name=null)" for c in conflicts]
        )
    return Standing(config, run_path, resume, address, named, derived)


# What a recipe's derive_settings may decide: the model's shape, and what its outputs mean.
DERIVABLE = ("model.", "data.class_names")


def from_the_data(config: Config) -> tuple[Config, dict[str, Any]]:
    """`config` with the settings the recipe's `derive_settings` reads from the data, and those
    settings; a recipe that cannot read them, or a value the user set that differs, is a ConfigError."""
    recipe = layering.origin_of(config).recipe
    if recipe.derive_settings is None:
        return config, {}
    kwargs = recipe.derived_from(config)
    try:
        derived = dict(recipe.derive_settings(**kwargs))
    except Exception as e:  # noqa: BLE001 - whatever the recipe raises, with its own message
        failed = f"recipe {recipe.name}: {where(recipe.derive_settings, 'derive_settings', e)} failed"
        raise ConfigError(config.job, [f"{failed}: {type(e).__name__}: {e}"]) from e
    if wrong := [key for key in derived if not key.startswith(DERIVABLE)]:
        allowed = "model.* and data.class_names"
        raise ConfigError(
            config.job, [f"recipe {recipe.name}: derive_settings may set {allowed}, not {', '.join(wrong)}"]
        )
    read = ", ".join(f"dataset.{k}={layering.yaml_value(v)}" for k, v in kwargs.items() if k in config.dataset)
    config = layering.with_data_settings(config, derived, f"the data ({read})")
    flat = config.flat()
    return config, {key: flat[key] for key in derived}  # as validated: a tuple of names is a list


def finished_config(run_path: str, tracking_uri: str | None) -> Config:
    """The config a finished run was trained with, from its newest checkpoint that verifies, with the
    run where it is now (a run directory may have been moved) and, if given, another tracking server.
    A run that has not finished training is refused, with the command that resumes it."""
    run_path = storage.absolute(run_path)
    storage_path, name = run_path.rsplit("/", 1)
    record = ckpt.run_record(run_path)
    if record is None:
        raise ConfigError(name, [f"{run_path}: no committed checkpoint there; give the directory of a run"])
    unrecorded = ckpt.unrecorded(run_path, Path(record.checkpoint.path).name)
    with ckpt.open_resume_point(record.checkpoint, record.best_checkpoints, unrecorded) as latest:
        saved = Config.from_dict(latest.verified.config())
        metrics = latest.verified.metrics()
    config = saved.model_copy(
        update={
            "run": saved.run.model_copy(update={"storage_path": storage_path, "name": name}),
            "mlflow": saved.mlflow.model_copy(update={"tracking_uri": tracking_uri or saved.mlflow.tracking_uri}),
        }
    )
    if (epoch := metrics["epoch"]) < config.train.epochs and ended_early(metrics, config) is None:
        resume = resume_command(resolve(config, layering.origin_of(config).job.name))
        raise ConfigError(
            config.job,
            [f"run {name} has not finished training (epoch {epoch:g} of {config.train.epochs}); resume it: {resume}"],
        )
    return config


def resume_command(config: Config, *, epochs: str | None = None) -> str:
    """The command that continues the run of a resolved `config`: its name, and every setting that
    differs from its job's own YAML (a resumed run must keep them), resolved as from the current
    directory; `epochs`, if given, replaces train.epochs."""
    job_yaml = _with_name(layering.job_config(config), config.run.name)
    overrides = layering.overrides_against(config, resolve(job_yaml, layering.origin_of(config).job.name))
    if epochs is not None:
        overrides = [o for o in overrides if not o.startswith("train.epochs=")] + [f"train.epochs={epochs}"]
    return shlex.join(["raytrain-ddp", "train", config.job, f"run.name={config.run.name}", *overrides])


def _with_name(config: Config, name: str | None) -> Config:
    return config.model_copy(update={"run": config.run.model_copy(update={"name": name})})


def resolve(config: Config, job_name: str) -> Config:
    """Fill what defaults to 'decide at run time': run name, absolute paths, MLflow names."""
    run_name = config.run.name or f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    run = {"name": run_name, "storage_path": storage.absolute(config.run.storage_path)}
    mlflow = {
        "tracking_uri": endpoint.resolve_tracking_uri(config.mlflow.tracking_uri),
        "experiment": config.mlflow.experiment or job_name,
        "model_name": config.mlflow.model_name or job_name,
    }
    return config.model_copy(
        update={"run": config.run.model_copy(update=run), "mlflow": config.mlflow.model_copy(update=mlflow)}
    )


def resume_point(run_path: str, config: Config) -> ResumePoint:
    """Where a run of `config` in `run_path` would resume: its newest checkpoint that verifies (an
    empty ResumePoint: none, a new run). Raises RunFailed where every checkpoint is damaged."""
    record = ckpt.run_record(run_path)
    latest, committed = (record.checkpoint, record.best_checkpoints) if record is not None else (None, [])
    unrecorded = ckpt.unrecorded(run_path, None if latest is None else Path(latest.path).name)
    if latest is None and not unrecorded:
        return ResumePoint()
    c = config.checkpoint
    ranked = ckpt.best_first(ckpt.reported(run_path, record, unrecorded), c.score_attribute, c.score_order)
    best = ranked[0][1] if ranked else None
    # An elastic run's number of workers is what the cluster has room for when they start: the workers
    # pass over a mid-epoch checkpoint of another number themselves.
    workers = None if config.scaling.elastic else config.scaling.num_workers
    try:
        with ckpt.open_resume_point(latest, committed, unrecorded, workers) as opened:
            if opened is None:  # nothing recorded, and nothing written whole: a new run
                return ResumePoint()
            metrics = opened.verified.metrics()
            skipped = [str(s) for s in opened.skipped]
            return ResumePoint(
                opened.name,
                float(metrics["epoch"]),
                int(metrics["step"]),
                skipped,
                opened.verified.config(),
                best,
                metrics,
            )
    except ckpt.NoValidCheckpoint as e:
        raise RunFailed(
            f"run {config.run.name} cannot resume: {e}\nrestore the files, or start a new run (run.name=null)"
        ) from None
