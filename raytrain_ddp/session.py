"""The Ray session a command runs in, and the environment it sets up for Ray and MLflow."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import ray
import ray.data

from raytrain_ddp import tracking

# Ray Train reads its controller's poll interval from the driver's environment when fit() starts.
CONTROLLER_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def connect(verbose: bool) -> None:
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


def bounded_mlflow_retries() -> contextlib.AbstractContextManager:
    """MLflow's HTTP retries bounded (tracking.BOUNDED_RETRIES), unless the environment sets them."""
    return environment({key: os.environ.get(key, value) for key, value in tracking.BOUNDED_RETRIES.items()})


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
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
