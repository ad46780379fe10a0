"""What a run needs before its checks, made once the run stands (plan.stand): Ray joined or started (the
processes Ray Train will take asked for ahead), the tracking store opened beside it, the recipe's
datasets built and two validation rows taken: the `Plan`."""

from __future__ import annotations

import functools
from typing import Any

from rich.console import Console

from raytrain_ddp.cluster import prestart, ray_address, session
from raytrain_ddp.config import layering
from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config, ConfigError
from raytrain_ddp.data import datasets as data
from raytrain_ddp.data import stream
from raytrain_ddp.driver.plan import Plan, Standing, resume_command
from raytrain_ddp.driver.timeline import Timeline
from raytrain_ddp.preflight.recipe_check import where
from raytrain_ddp.registry import sqlite_store


def make(standing: Standing, *, verbose: bool, console: Console, clock: Timeline) -> Plan:
    """The plan of the run that `standing` found: Ray joined or started, the recipe imported and its
    datasets built. Raises ConfigError for a recipe that breaks the contract or cannot build its
    datasets, or a RAY_ADDRESS that answers but not as a Ray cluster."""
    config, origin = standing.config, layering.origin_of(standing.config)
    recipe = origin.recipe
    session.quiet_logs(verbose)  # before the store opens on a thread: MLflow's INFO lines off the console
    with sqlite_store.opening_store(config.mlflow.tracking_uri):
        if standing.address.note:
            console.print(f"[dim]{standing.address.note}[/]", highlight=False)
        with console.status("Starting Ray…"):
            _connect(config, standing.address, verbose)
        clock.mark("ray")
        with console.status("Building datasets…"):
            datasets, fitted = _build_datasets(config, recipe)
            # The controller's process, now that the workers' have started (prestart.start_controller).
            prestart.start_controller(config)
            train_rows = data.num_rows(datasets["train"])
            clock.mark("datasets")
            example = data.example_batch(datasets["val"], config.seed)
            clock.mark("example rows")
    return Plan(
        config=config,
        recipe=recipe,
        run_path=standing.run_path,
        datasets=datasets,
        fitted=fitted,
        train_rows=train_rows,
        example=example,
        resume=standing.resume,
        resume_command=resume_command(config),
        extend_command=resume_command(config, epochs="N"),
        named=standing.named,
        derived=standing.derived,
    )


def _connect(config: Config, address: ray_address.RayAddress, verbose: bool) -> None:
    try:
        session.connect(address, verbose, functools.partial(prestart.ahead, config))
    except ConnectionError as e:  # the port answered, but not as a Ray GCS, or its GCS refused this process
        raise ConfigError(
            config.job,
            [
                f"RAY_ADDRESS={address.join}: the Ray cluster there could not be joined ({e}). "
                f"{ray_address.token_hint()}; or the address is not the head's GCS address "
                f"(host:{ray_address.GCS_PORT} by default); or unset RAY_ADDRESS to start a local Ray"
            ],
        ) from None


def _build_datasets(config: Config, recipe: Recipe) -> tuple[dict[str, Any], Any]:
    """The recipe's datasets, and what it fitted on the training rows; a recipe that cannot build them
    (a missing file, say) is a config problem: reported like one, before anything is started or written."""
    try:
        datasets = recipe.make_datasets(config)
    except Exception as e:  # noqa: BLE001 - whatever the recipe raises, with its own message
        failed = f"recipe {recipe.name}: {where(recipe.build_datasets, 'build_datasets', e)} failed"
        raise ConfigError(config.job, [f"{failed}: {type(e).__name__}: {e}"]) from e
    try:
        datasets, fitted = data.check_datasets(datasets, config.job)
    except TypeError as e:
        raise ConfigError(config.job, [str(e)]) from None
    if data.is_stream(datasets):  # listed once, here: every worker reads the same files
        try:
            datasets = {name: s.listed(config.data.max_bad_files) for name, s in datasets.items()}
        except stream.BadFile as e:
            raise ConfigError(config.job, [f"dataset: {e}"]) from None
    return datasets, fitted
