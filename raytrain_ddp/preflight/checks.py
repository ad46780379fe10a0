"""What is checked before any training worker starts, so that bad input costs seconds and writes nothing.

Before Ray starts (`check_before_ray`): a run another live driver holds, a RAY_ADDRESS where no cluster
answers, a tracking server that cannot be reached or refuses the credentials, storage that would vanish
with the job, train.compile where torch cannot compile. Then, with the plan in hand (`check`): the
whole recipe on two validation rows (a broken recipe is a RecipeFailed naming function, file and line)
and what one training step of it costs (its FLOPs, flops.py), the score metric, batch arithmetic,
whether the cluster can ever hold the workers, whether every node sees the storage. What a resumed
run may not change (`resume_conflicts`) is refused before Ray starts too, once the run's checkpoint is
read (plan.stand). Every problem is reported at once, as one ConfigError.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from raytrain_ddp import ray_compat
from raytrain_ddp.checkpoint import lease, storage
from raytrain_ddp.cluster import ray_address, session
from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config, ConfigError
from raytrain_ddp.preflight.batches import check_batches, check_group_by_length, check_steps
from raytrain_ddp.preflight.cluster import check_free_now, check_labels, check_resources
from raytrain_ddp.preflight.recipe_check import check_recipe, check_score
from raytrain_ddp.registry import endpoint
from raytrain_ddp.worker.flops import ModelFlops


def check_before_ray(config: Config, run_path: str) -> ray_address.RayAddress:
    """Raise RunBusy if another live driver trains the run, ConfigError for a RAY_ADDRESS where no
    cluster answers, a tracking server that cannot be used, paths that would not outlast the job or
    train.compile on a machine that cannot compile: seconds, before Ray starts. Returns the Ray to join."""
    lease.check(run_path)
    address = session.ray_address()
    server = endpoint.check_server(config.mlflow.tracking_uri)
    problems = check_lasting_paths(config) + check_compile(config) + check_ray_release(config)
    if problems := problems + [p for p in (address.problem, server) if p]:
        raise ConfigError(config.job, problems)
    return address


# Settings that need a later Ray than the oldest the service runs on: setting, the first release with it.
RAY_FLOORS = {"data.label_selector": ((2, 56), "Ray Data's reading tasks ignore a label selector before it")}


def check_ray_release(config: Config) -> list[str]:
    """A setting the installed Ray cannot honour (RAY_FLOORS), named with the release it needs."""
    release = ray_compat.ray_release()
    problems = []
    for key, (first, why) in RAY_FLOORS.items():
        section, name = key.split(".")
        if getattr(getattr(config, section), name) and release < first:
            problems.append(
                f"{key} needs Ray {first[0]}.{first[1]} or newer ({why}); this is Ray {release[0]}.{release[1]}: "
                f"upgrade Ray, or unset {key}"
            )
    return problems


def check_compile(config: Config) -> list[str]:
    """What train.compile needs of the machine, checked on the driver's (the workers' nodes are
    expected to run the same image): a Python that torch.compile supports and, to train on CPU, a
    C++ compiler for inductor's kernels (on GPU it writes Triton kernels, shipped with torch)."""
    if not config.train.compile:
        return []
    if not torch._dynamo.is_dynamo_supported():
        python = sys.version.split()[0]
        return [f"train.compile: torch {torch.__version__} cannot compile on Python {python}; set train.compile=false"]
    if config.scaling.use_gpu:
        return []
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler, or whatever else stops it finding one
        return [
            f"train.compile: compiling for CPU needs a C++ compiler and none works on this machine ({e}); "
            "install g++ (apt-get install g++), set CXX to one, or set train.compile=false"
        ]
    return []


def check(
    config: Config,
    recipe: Recipe,
    datasets: dict[str, Any],
    *,
    example: dict[str, torch.Tensor],
    fitted: Any,
    train_rows: int,
    saved_config: Mapping[str, Any] | None,
) -> ModelFlops:
    """Everything else that can rule the run out without starting a worker, reported at once.
    Returns what a training step of the model costs, found on the way (flops.py)."""
    checked = check_recipe(config, recipe, example, fitted)
    problems = (
        check_score(config, checked.reported)
        + check_batches(config, train_rows)
        + check_group_by_length(config, datasets, example)
        + check_steps(config, saved_config, train_rows)
        + check_resources(config, datasets)
        + check_labels(config)
        + check_free_now(config)
        + storage.check_shared(config.run.storage_path)
    )
    if problems:
        raise ConfigError(config.job, problems)
    return checked.flops


def check_lasting_paths(config: Config) -> list[str]:
    """Under `ray job submit` the driver runs in a copy of the working directory that Ray deletes
    after the job: the relative defaults (./runs, sqlite:///mlflow.db) would vanish with it."""
    temporary = "/runtime_resources/"  # where Ray unpacks a job's working_dir, in its session directory
    problems = []
    if temporary in config.run.storage_path:
        problems.append(
            f"run.storage_path: {config.run.storage_path} is in the job's temporary working directory, which Ray "
            "deletes when the job ends; set run.storage_path to storage that outlasts it (s3://bucket/runs, "
            "a shared mount)"
        )
    if config.mlflow.tracking_uri.startswith("sqlite:") and temporary in config.mlflow.tracking_uri:
        problems.append(
            f"mlflow.tracking_uri: {config.mlflow.tracking_uri} is in the job's temporary working directory, which Ray "
            "deletes when the job ends; set mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to a tracking server"
        )
    return problems
