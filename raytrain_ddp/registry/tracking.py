"""The MLflow run of a training run: created before training (or found again when the run resumes),
each report's metrics logged as the report reaches the driver (`MetricsLog`), ended as the run ends.

MLflow is the driver's alone: neither Ray Train's controller nor the workers import it. The registry's
other modules: endpoint.py (the tracking URI and its probe), sqlite_store.py (a local store opened while
Ray starts), model_registry.py (versions and the `champion` alias), model_logging.py (the model logged).
mlflow is imported where it is first used, not with these modules: the command imports the driver's
modules before Ray starts, and mlflow (seconds of imports on a small machine) comes in on
`sqlite_store.opening_store`'s thread instead, while Ray starts and the driver waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from raytrain_ddp.config.schema import Config
from raytrain_ddp.registry.endpoint import check_server, mlflow_client, sqlite_file
from raytrain_ddp.registry.records import (
    GENERATED_FILE,
    RUN_NAME_TAG,
    RUN_PATH_TAG,
    SKIPPED_FILES,
    SKIPPED_FILES_TAG,
    STOPPED_EARLY_TAG,
)
from raytrain_ddp.registry.sqlite_store import put_new_database_in_place
from raytrain_ddp.worker.metrics import GENERATED, STOPPED_EARLY

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
logger = logging.getLogger(__name__)


def start_run(config: Config, run_path: str, extra_params: Mapping[str, str] | None = None) -> str:
    """The MLflow run of the training run at `run_path`: created on the first attempt, continued when
    the run resumes. Params are the flattened config and `extra_params` (what the run found out before
    training: the model's FLOPs); a value changed on resume (train.epochs, say: see preflight/resume.py's RESUMABLE)
    is kept as a tag, since MLflow params cannot change."""
    from mlflow.entities import Param, RunStatus

    put_new_database_in_place(config.mlflow.tracking_uri)
    client = mlflow_client(config.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(config.mlflow.experiment)
    experiment_id = experiment.experiment_id if experiment else _new_experiment(client, config)
    name, path = config.run.name, run_path
    found = client.search_runs([experiment_id], filter_string=_identity(name, path), max_results=1)
    params = {key: str(value) for key, value in config.flat().items()} | dict(extra_params or {})
    if found:
        run = found[0]
        client.update_run(run.info.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        changed = {k: v for k, v in params.items() if k in run.data.params and run.data.params[k] != v}
        for key, value in changed.items():
            client.set_tag(run.info.run_id, f"changed_on_resume.{key}", value)
        params = {k: v for k, v in params.items() if k not in run.data.params}
    else:
        run = client.create_run(
            experiment_id, run_name=name, tags={RUN_NAME_TAG: name, RUN_PATH_TAG: path, "job": config.job}
        )
    items = list(params.items())
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items[i : i + 100]])
    client.log_dict(run.info.run_id, config.to_dict(), "config.yaml")
    return run.info.run_id


def _new_experiment(client: MlflowClient, config: Config) -> str:
    """A new experiment; in a sqlite store, its artifacts (the registered models' files among them)
    beside the database, as `mlruns/<id>`, not under the driver's working directory, where MLflow
    would put them: under `ray job submit` that is the job's copy, which Ray deletes with the job."""
    uri, name = config.mlflow.tracking_uri, config.mlflow.experiment
    if (database := sqlite_file(uri)) is None:
        return client.create_experiment(name)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    return SqlAlchemyStore(uri, str(database.absolute().parent / "mlruns")).create_experiment(name)


def find_run(config: Config, run_path: str) -> str | None:
    """The id of the MLflow run of the training run at `run_path`, if the tracking store has one; a
    database that does not exist is not created."""
    uri = config.mlflow.tracking_uri
    if (database := sqlite_file(uri)) is not None and not database.is_file():
        return None
    client = mlflow_client(uri)
    experiment = client.get_experiment_by_name(config.mlflow.experiment)
    if experiment is None:
        return None
    found = client.search_runs(
        [experiment.experiment_id], filter_string=_identity(config.run.name, run_path), max_results=1
    )
    return found[0].info.run_id if found else None


def _identity(run_name: str, run_path: str) -> str:
    return f"tags.`{RUN_NAME_TAG}` = '{run_name}' and tags.`{RUN_PATH_TAG}` = '{run_path}'"


class MetricsLog:
    """Each report's global metrics, logged to the MLflow run at the report's optimizer step (`epoch`
    is a metric too, fractional mid-epoch) as the report reaches the driver (`add`, from the progress
    display, which `callbacks.ProgressRelay` sends every report), in order, on a thread of its own:
    the display never waits for MLflow. Also the samples a recipe generates at each evaluation (one
    table for the run, a row per sample and evaluation) and, on the report that ends a run early, why.

    Leaving the block waits until every report added is logged, so when fit() has returned the run's
    metrics are all in MLflow. A store that is unavailable costs a warning, never the training: every
    checkpoint's metrics.json keeps the numbers. A tracking server that does not answer costs MLflow's
    bounded retries (session.bounded_mlflow_retries) once: until it answers again, each report asks it
    once, without retries (`check_server`), so reports queued behind a server that is down do not
    hold the run's end for their retries; one warning when it answers again, or at the end, names
    the reports not logged."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.client, self.run_id, self.tracking_uri = mlflow_client(tracking_uri), run_id, tracking_uri
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-metrics")
        self._unreachable: str | None = None  # why the tracking server did not answer, until it does
        self._skipped: list[int] = []  # the steps of the reports not logged meanwhile

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self._thread.shutdown(wait=True)
        if self._skipped:
            logger.warning(
                "MLflow: %s were not logged: %s (each checkpoint's metrics.json keeps them)",
                _reports(self._skipped),
                self._unreachable,
            )

    def add(self, reported: dict[str, Any]) -> Future:
        """Log the report on the log's thread; the returned future is done once it is logged (or not)."""
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(reported["step"])
        batch = [Metric(k, float(v), now, step) for k, v in reported.items() if _is_number(v) and k != "step"]
        return self._thread.submit(self._log, step, batch, reported.get(GENERATED), reported.get(STOPPED_EARLY))

    def _log(self, step: int, batch: list[Metric], generated: list[dict[str, str]] | None, stopped_early: str | None):
        if self._unreachable is not None:
            if check_server(self.tracking_uri) is not None:
                self._skipped.append(step)
                return
            if self._skipped:
                logger.warning(
                    "MLflow: the tracking server answers again; %s were not logged meanwhile (each "
                    "checkpoint's metrics.json keeps them)",
                    _reports(self._skipped),
                )
            self._unreachable, self._skipped = None, []
        try:
            self.client.log_batch(self.run_id, metrics=batch)
            if generated:
                columns = {key: [row[key] for row in generated] for key in generated[0]}
                self.client.log_table(self.run_id, {"step": [step] * len(generated), **columns}, GENERATED_FILE)
            if stopped_early:
                self.client.set_tag(self.run_id, STOPPED_EARLY_TAG, stopped_early)
        except Exception as e:  # noqa: BLE001 - any tracking failure, see the docstring
            self._unreachable = check_server(self.tracking_uri)  # None: a store, or a server that answers
            until = "; the next reports ask the server once each, without retries" if self._unreachable else ""
            logger.warning(
                "MLflow: step %d metrics not logged (%s)%s; see the checkpoint's metrics.json", step, e, until
            )


def _reports(steps: list[int]) -> str:
    """'the metrics of 2 reports (steps 8-12)'."""
    if len(steps) == 1:
        return f"the metrics of 1 report (step {steps[0]})"
    return f"the metrics of {len(steps)} reports (steps {steps[0]}-{steps[-1]})"


def finish_run(config: Config, run_id: str, status: Literal["FINISHED", "FAILED", "KILLED"]) -> None:
    mlflow_client(config.mlflow.tracking_uri).set_terminated(run_id, status)


def nest(config: Config, run_id: str, parent_id: str, tags: Mapping[str, str]) -> None:
    """The run shown under `parent_id` (a sweep's) in MLflow's UI, with `tags`; ended FINISHED if it is
    still RUNNING (a sweep's scheduler stopped it: its process ended before it could say so)."""
    client = mlflow_client(config.mlflow.tracking_uri)
    for key, value in {"mlflow.parentRunId": parent_id, **tags}.items():
        client.set_tag(run_id, key, value)
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, "FINISHED")


def log_file(config: Config, run_id: str, path: str) -> None:
    mlflow_client(config.mlflow.tracking_uri).log_artifact(run_id, path)


def log_best(config: Config, run_id: str, score: str, value: float, trial: str) -> None:
    """A sweep's best score as its run's metric, and the trial that reached it as a tag."""
    client = mlflow_client(config.mlflow.tracking_uri)
    client.log_metric(run_id, f"best_{score}", value)
    client.set_tag(run_id, "sweep.best_trial", trial)


def end_failed_run(config: Config, run_id: str, status: Literal["FAILED", "KILLED"]) -> None:
    """Mark the MLflow run ended on the way out of a failure, without hiding that failure."""
    try:
        finish_run(config, run_id, status)
    except Exception as e:  # noqa: BLE001
        logger.warning("could not mark MLflow run %s %s: %s", run_id, status, e)


def log_texts(config: Config, run_id: str, texts: dict[str, str]) -> None:
    """The recipe's artifacts (a generated sample, say), as text files of the run."""
    client = mlflow_client(config.mlflow.tracking_uri)
    for file_name, text in texts.items():
        client.log_text(run_id, text, file_name)


def log_skipped(config: Config, run_id: str, lines: list[str]) -> None:
    """The unreadable files a run left out, a line each: their count as a tag of the run (beside the
    per-epoch `data_bad_files` metric: the files found in reading), their lines as an artifact."""
    client = mlflow_client(config.mlflow.tracking_uri)
    client.set_tag(run_id, SKIPPED_FILES_TAG, str(len(lines)))
    client.log_text(run_id, "\n".join(lines) + "\n", SKIPPED_FILES)


@contextlib.contextmanager
def active_run(tracking_uri: str, run_id: str) -> Iterator[None]:
    """Model logging and registration go through MLflow's global tracking URI and "active run": set
    them for the call, then put back the caller's (a notebook may have its own run open). MLflow keeps
    its global URI in $MLFLOW_TRACKING_URI too: put back as it was, unset if it was (restoring the
    resolved default instead would pin every later run of the process to this directory's mlflow.db)."""
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")  # set with the global by mlflow.set_tracking_uri
    mlflow.set_tracking_uri(tracking_uri)
    try:
        with mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None):
            yield
    finally:
        mlflow.set_tracking_uri(previous)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
