"""MLflow: one MLflow run per training run, metrics logged live, the final model registered.

The driver's only module that imports mlflow, and the driver the only process that talks to MLflow
(neither Ray Train's controller nor the workers import it): it creates the run before training, logs
each report's metrics as the report reaches it (`MetricsLog`), and registers the best checkpoint's
model after training, moving the model's `champion` alias as champion.py's rule says
(`converge_champion`; `promote` by hand).

mlflow is imported where it is first used, not with this module: the command imports the driver's
modules before Ray starts, and mlflow (1.5 s of imports on 2 cores) comes in on `opening_store`'s
thread instead, while Ray starts and the driver waits for it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from raytrain_ddp.config.schema import Config
from raytrain_ddp.registry import champion
from raytrain_ddp.worker.metrics import GENERATED, STOPPED_EARLY

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
RUN_NAME_TAG = "raytrain_ddp.run_name"
RUN_PATH_TAG = "raytrain_ddp.run_path"  # <storage_path>/<run name>: with the name, what identifies a run
CHECKPOINT_TAG = "raytrain_ddp.checkpoint"
# On each registered version: the checkpoint's score, so mlflow.register=if_better compares numbers
# it knows the meaning of (a version without them, or on another metric, is not comparable).
SCORE_ATTRIBUTE_TAG = "raytrain_ddp.score_attribute"
SCORE_ORDER_TAG = "raytrain_ddp.score_order"
SCORE_TAG = "raytrain_ddp.score"
# The alias `champion` follows champion.champion(); each version says how it fared (champion.verdict),
# and the registered model keeps the last promotion by hand (`raytrain-ddp promote`).
CHAMPION = "champion"
CHAMPION_TAG = "raytrain_ddp.champion"
PROMOTED_TAG = "raytrain_ddp.promoted"
MODEL_ARTIFACT = "model"
GENERATED_FILE = "generated.json"  # what the model generated at each evaluation (generate_samples)
STOPPED_EARLY_TAG = "raytrain_ddp.stopped_early"  # on the MLflow run that early stopping ended: why
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Score:
    """A checkpoint's score: the value of `checkpoint.score_attribute`, and whether more is better."""

    attribute: str
    order: Literal["max", "min"]
    value: float


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    version: int
    uri: str  # models:/<name>/<version>
    score: Score | None = None  # from the version's tags; None for a version registered without them
    champion: str = ""  # how it fared against the champion when it was registered (champion.verdict)


def resolve_tracking_uri(setting: str | None) -> str:
    """Config, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db; relative sqlite paths made absolute,
    because Ray's processes that use it (the registering task's) do not share the driver's working directory."""
    uri = setting or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri.removeprefix(prefix)).resolve())
    return uri


def check_server(tracking_uri: str, connect_timeout_s: float = 3.0, answer_timeout_s: float = 60.0) -> str | None:
    """For an HTTP(S) tracking server: one API call, with the environment's credentials and no
    retries, so a server that is down or unreachable (no connection within `connect_timeout_s`), or
    that refuses the credentials, is reported in seconds, before anything trains (MLflow's own client
    retries for minutes). A server that accepts the connection gets `answer_timeout_s` to answer: a
    busy server's first call can be slow. Returns the problem, or None; never shows credentials."""
    if not is_server(tracking_uri):
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(
            get_default_host_creds(tracking_uri),
            "/api/2.0/mlflow/experiments/search",
            "GET",
            params={"max_results": 1},
            max_retries=0,
            timeout=(connect_timeout_s, answer_timeout_s),
            raise_on_status=False,
        )
    except MlflowException as e:
        return (
            f"mlflow.tracking_uri: the MLflow tracking server {tracking_uri} is unreachable "
            f"({_network_reason(e.__cause__ or e.__context__, connect_timeout_s, answer_timeout_s)}); start it, "
            "or point mlflow.tracking_uri (or MLFLOW_TRACKING_URI) at one that runs"
        )
    if response.status_code in (401, 403):
        return (
            f"mlflow.tracking_uri: the MLflow tracking server {tracking_uri} refused the credentials "
            f"(HTTP {response.status_code}); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
            "(or MLFLOW_TRACKING_TOKEN) in the environment"
        )
    if response.status_code != 200:
        return (
            f"mlflow.tracking_uri: {tracking_uri} does not answer like an MLflow tracking server "
            f"(HTTP {response.status_code} for its experiments API)"
        )
    return None


def _network_reason(error: BaseException | None, connect_timeout_s: float, answer_timeout_s: float) -> str:
    text = str(error)
    for marker, reason in (
        ("Connection refused", "connection refused"),
        ("connect timeout", f"no connection within {connect_timeout_s:g} s"),
        ("Read timed out", f"connected, but no answer within {answer_timeout_s:g} s"),
        ("Name or service not known", "unknown host"),
        ("Failed to resolve", "unknown host"),
    ):
        if marker in text:
            return reason
    return type(error).__name__


def is_server(tracking_uri: str) -> bool:
    """A tracking server (HTTP), not a store this process opens itself (a database, say)."""
    return tracking_uri.startswith(("http://", "https://"))


def ui_command(tracking_uri: str) -> str:
    if is_server(tracking_uri):
        return f"open {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


@contextlib.contextmanager
def opening_store(tracking_uri: str) -> Iterator[None]:
    """Open the tracking store in this process (MLflow keeps it) on a thread while the block runs: for
    a database, a second or two of imports, connecting and checking the schema, spent while Ray starts.
    A sqlite database that does not exist yet is made beside it under a hidden name (a copy of an
    empty one of MLflow's schema: `_new_database`), and `start_run` moves it into place once the run
    is accepted: a run refused before that leaves no database behind, and neither does a process that
    exits first. Errors are left to the calls that follow, which report them."""
    database = _sqlite_file(tracking_uri)
    if database is not None and not database.exists() and database.parent.is_dir():
        target, new = _new_database, database.with_name(f".{database.name}.{os.getpid()}.new")
    elif is_server(tracking_uri) or database is not None and database.is_file():
        target, new = _open_store, None
    else:
        yield
        return

    thread = threading.Thread(target=target, args=(new or tracking_uri,), name="mlflow-open-store", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:  # the run refused: no database left behind
        thread.join()
        if new is not None:
            new.unlink(missing_ok=True)
        raise
    thread.join()
    if new is not None and new.is_file():
        _new_databases[tracking_uri] = new


_new_databases: dict[str, Path] = {}  # tracking URI -> its database, made by opening_store, not yet in place


def _sqlite_file(tracking_uri: str) -> Path | None:
    """The file of a sqlite tracking URI (`sqlite:///relative.db`, `sqlite:////absolute.db`), else None."""
    scheme, _, rest = tracking_uri.partition(":")
    path = rest.removeprefix("///") if scheme == "sqlite" and rest.startswith("///") else ""
    return Path(path) if path else None


def _client(tracking_uri: str) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri)


def _open_store(tracking_uri: str) -> bool:
    """The store opened (True), or not: the calls that follow say why."""
    try:
        _client(tracking_uri).search_experiments(max_results=1)
    except Exception:  # noqa: BLE001
        return False
    return True


def _new_database(path: Path) -> None:
    """A new sqlite store at `path`: a copy of an empty one with this MLflow's schema, opened, MLflow
    adding what belongs to this store (its Default experiment, with artifacts beside it). Where no
    copy can be had, or it does not open, MLflow makes the store itself; failing that, it is left to
    MLflow to make, and start_run says what failed."""
    uri = f"sqlite:///{path}"
    if copy_empty_schema(path):
        if _open_store(uri):
            return
        _schema_file().unlink(missing_ok=True)  # not this MLflow's schema after all, or damaged: made again next time
        path.unlink(missing_ok=True)
    if not _open_store(uri):
        path.unlink(missing_ok=True)


def copy_empty_schema(path: Path) -> bool:
    """Make `path` a copy of an empty sqlite database of this MLflow's schema (`_empty_schema`), for
    MLflow to open as a new store without running its migrations. False where none can be had."""
    if (schema := _empty_schema()) is None:
        return False
    try:
        shutil.copyfile(schema, path)
    except OSError:
        path.unlink(missing_ok=True)
        return False
    return True


def _schema_file() -> Path:
    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raytrain_ddp"
    return cache / f"mlflow-{mlflow.__version__}-empty.db"


def _empty_schema() -> Path | None:
    """An empty sqlite database of this MLflow's schema, made once per MLflow version in the user's
    cache (`$XDG_CACHE_HOME`, else ~/.cache): MLflow makes a store's schema by running its ~60
    migrations, 2-6 s on 2 cores, which every new store paid. Made as MLflow's store makes it on an
    empty database (`_initialize_tables`), then moved into place whole. None where the cache cannot
    be written, or MLflow no longer makes a schema that way."""
    schema = _schema_file()
    if schema.is_file():
        return schema
    part = schema.with_name(f".{schema.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine_with_retry

        schema.parent.mkdir(parents=True, exist_ok=True)
        engine = create_sqlalchemy_engine_with_retry(f"sqlite:///{part}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(part, schema)  # whole, or not at all: another driver's may land first, the same
    except Exception:  # noqa: BLE001 - no cache here (a read-only home, say): MLflow makes the store
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        return None
    return schema


def _put_new_database_in_place(tracking_uri: str) -> None:
    """The database opening_store made for `tracking_uri`, under its own name: never over one made
    meanwhile (another driver's), and where a hard link cannot be made, left to MLflow to create."""
    new = _new_databases.pop(tracking_uri, None)
    if new is None:
        return
    try:
        os.link(new, _sqlite_file(tracking_uri))
    except OSError:
        pass
    new.unlink(missing_ok=True)


def _discard_new_databases() -> None:
    """At exit, the databases opening_store made that no run took (a run refused after its plan)."""
    while _new_databases:
        _, new = _new_databases.popitem()
        new.unlink(missing_ok=True)


atexit.register(_discard_new_databases)


def start_run(config: Config, run_path: str, extra_params: Mapping[str, str] | None = None) -> str:
    """The MLflow run of the training run at `run_path`: created on the first attempt, continued when
    the run resumes. Params are the flattened config and `extra_params` (what the run found out before
    training: the model's FLOPs); a value changed on resume (train.epochs, say: see preflight.RESUMABLE)
    is kept as a tag, since MLflow params cannot change."""
    from mlflow.entities import Param, RunStatus

    _put_new_database_in_place(config.mlflow.tracking_uri)
    client = _client(config.mlflow.tracking_uri)
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
    if (database := _sqlite_file(uri)) is None:
        return client.create_experiment(name)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    return SqlAlchemyStore(uri, str(database.absolute().parent / "mlruns")).create_experiment(name)


def find_run(config: Config, run_path: str) -> str | None:
    """The id of the MLflow run of the training run at `run_path`, if the tracking store has one; a
    database that does not exist is not created."""
    uri = config.mlflow.tracking_uri
    if (database := _sqlite_file(uri)) is not None and not database.is_file():
        return None
    client = _client(uri)
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
        self.client, self.run_id, self.tracking_uri = _client(tracking_uri), run_id, tracking_uri
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
    _client(config.mlflow.tracking_uri).set_terminated(run_id, status)


def end_failed_run(config: Config, run_id: str, status: Literal["FAILED", "KILLED"]) -> None:
    """Mark the MLflow run ended on the way out of a failure, without hiding that failure."""
    try:
        finish_run(config, run_id, status)
    except Exception as e:  # noqa: BLE001
        logger.warning("could not mark MLflow run %s %s: %s", run_id, status, e)


def register_model(
    config: Config,
    run_id: str,
    checkpoint_path: str,
    score: Score,
    log_model: Callable[[str], Any],
    lineage: Mapping[str, str] | None = None,
) -> RegisteredModel:
    """Log the best checkpoint's model (`log_model(name)`, inside the MLflow run, returns MLflow's
    ModelInfo) and register it as a new version of `mlflow.model_name`, tagged with the checkpoint,
    its score and `lineage` (what it was made of); then move `champion` as the registry now says
    (`converge_champion`) and write on the version how it fared. Callers first ask
    `registered_version`: registering a checkpoint twice returns its version."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = _client(config.mlflow.tracking_uri)
    name = config.mlflow.model_name
    # Inside: registering a `models:/m-...` source resolves it through MLflow's global tracking URI.
    with _active_run(config.mlflow.tracking_uri, run_id):
        info = log_model(name=MODEL_ARTIFACT)
        mlflow.set_tag(CHECKPOINT_TAG, checkpoint_path)
        try:
            client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = client.create_model_version(
            name,
            source=info.model_uri,
            run_id=run_id,
            model_id=info.model_id,
            tags={
                CHECKPOINT_TAG: checkpoint_path,
                RUN_NAME_TAG: config.run.name,
                SCORE_ATTRIBUTE_TAG: score.attribute,
                SCORE_ORDER_TAG: score.order,
                SCORE_TAG: repr(score.value),
                **(lineage or {}),
            },
        )
    number = int(version.version)
    try:
        registry = converge_champion(client, name)
        registered = next(v for v in registry.versions if v.version == number)
        verdict = champion.verdict(registry.versions, registry.promotion, registered)
        client.set_model_version_tag(name, version.version, CHAMPION_TAG, verdict)
    except MlflowException as e:  # the version is registered: the next registration or promotion moves it
        logger.warning("registered %s version %s, but could not move its champion alias: %s", name, number, e)
        return replace(_registered(version), champion=f"champion alias not moved: MLflow said {e.error_code}")
    return replace(registered, champion=verdict)


@dataclass(frozen=True)
class Registry:
    """What the registry holds of a model, as one pass of reads found it."""

    versions: list[RegisteredModel]
    promotion: champion.Promotion | None
    champion: int | None  # the version the alias points at


def read_registry(client: MlflowClient, name: str) -> Registry:
    """A model's versions, its last promotion and its champion alias; raises MlflowException
    (RESOURCE_DOES_NOT_EXIST) for a model that is not registered."""
    model = client.get_registered_model(name)
    versions, token = [], None
    while True:
        page = client.search_model_versions(f"name = '{name}'", page_token=token)
        versions += [_registered(v) for v in page]
        if not (token := page.token):
            break
    aliases = model.aliases or {}
    current = int(aliases[CHAMPION]) if CHAMPION in aliases else None
    return Registry(versions, champion.Promotion.from_tag(model.tags.get(PROMOTED_TAG)), current)


def converge_champion(client: MlflowClient, name: str, rounds: int = 10) -> Registry:
    """Point `champion` at the version champion.champion() picks from the registry, then read again,
    until a read finds the alias where the rule says (`rounds` at most; then a warning). Returns that
    read.

    MLflow has no compare-and-set, so two processes registering at once can each read, decide and
    write in any interleaving; what makes the end state right is that every process that changes the
    registry (a new version, a promotion) runs this afterwards, and stops only on a read that agrees.
    Take the last change of the registry and the last write of the alias: whichever came later, the
    process that made it reads after both, so it reads the final registry and the final alias, and it
    would have written again (a later write) had they disagreed. So the alias ends where the rule
    says for the final registry, whatever the order."""
    from mlflow.exceptions import MlflowException

    refused = None
    for attempt in range(rounds):
        registry = read_registry(client, name)
        wanted = champion.champion(registry.versions, registry.promotion)
        if registry.champion == (None if wanted is None else wanted.version):
            return registry
        try:
            if wanted is None:
                client.delete_registered_model_alias(name, CHAMPION)
            else:
                client.set_registered_model_alias(name, CHAMPION, str(wanted.version))
        except MlflowException as e:  # MLflow inserts a new alias without an upsert: two at once, one fails
            refused = e
        time.sleep(0.05 * attempt)  # another writer is at it: let it finish
    why = f" (last refused: {refused})" if refused is not None else ""
    logger.warning("%s: the champion alias kept moving under other writers%s; it may lag by a version", name, why)
    return registry


def promote(tracking_uri: str, name: str, version: int) -> tuple[int | None, int | None]:
    """Make `version` of model `name` champion by hand (`raytrain-ddp promote`): recorded on the
    registered model, so that later versions compete with it; returns the champion's version before
    and after. Raises LookupError for a model or version that does not exist (a sqlite store that
    does not exist is not created)."""
    if (database := _sqlite_file(tracking_uri)) is not None and not database.is_file():
        raise LookupError(f"no registered model '{name}' in {tracking_uri}: that store does not exist")
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        registry = read_registry(client, name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise LookupError(f"no registered model '{name}' in {tracking_uri}") from None
    numbers = sorted(v.version for v in registry.versions)
    if version not in numbers:
        known = ", ".join(map(str, numbers)) or "none"
        raise LookupError(f"model '{name}' has no version {version} (its versions: {known})")
    client.set_registered_model_tag(name, PROMOTED_TAG, champion.Promotion(version, numbers[-1]).tag())
    return registry.champion, converge_champion(client, name).champion


def registered_version(config: Config, run_id: str, checkpoint_path: str) -> RegisteredModel | None:
    """The version this run already registered for this checkpoint, if any."""
    name = config.mlflow.model_name
    for version in _client(config.mlflow.tracking_uri).search_model_versions(
        f"name = '{name}' and run_id = '{run_id}'"
    ):
        if version.tags.get(CHECKPOINT_TAG) == checkpoint_path:
            return _registered(version)
    return None


def latest_version(config: Config) -> RegisteredModel | None:
    """The newest version of `mlflow.model_name` (the highest number), with its score; None if the
    model has no version (or does not exist)."""
    name = config.mlflow.model_name
    found = _client(config.mlflow.tracking_uri).search_model_versions(
        f"name = '{name}'", max_results=1, order_by=["version_number DESC"]
    )
    return _registered(found[0]) if found else None


def _registered(version: Any) -> RegisteredModel:
    """A model version as MLflow returns it, with the score it was tagged with (if it was)."""
    tags = version.tags
    score = None
    if tags.get(SCORE_ORDER_TAG) in ("max", "min") and SCORE_ATTRIBUTE_TAG in tags:
        try:
            score = Score(tags[SCORE_ATTRIBUTE_TAG], tags[SCORE_ORDER_TAG], float(tags.get(SCORE_TAG, "")))
        except ValueError:  # edited by hand, say: not a number, so not comparable
            score = None
    name = version.name
    uri = f"models:/{name}/{version.version}"
    return RegisteredModel(name, int(version.version), uri, score, tags.get(CHAMPION_TAG, ""))


_preparing: threading.Thread | None = None  # prepare_model_logging's thread, once started


def prepare_model_logging() -> None:
    """Do, on a thread, the one-time work of `log_pytorch_model` (`rehearse_model_logging`), which the
    driver would otherwise wait for after training. Started once the ranks train (the driver's first
    progress or report from rank 0), not as Ray Train starts: on a small machine the start is the
    cores' work, and where the driver joined a cluster of another session the lowest priority below
    does not yield to it (bench/README.md measured 1 s of the first step). At the lowest CPU priority
    (`yield_the_cpu`): what the steps leave of the cores, within the driver's session."""
    global _preparing

    def prepare() -> None:
        yield_the_cpu()
        try:
            rehearse_model_logging()
        except Exception as e:  # noqa: BLE001 - only a head start: registration will say what is wrong
            logger.debug("preparing model logging: %s", e)

    logger.debug("preparing model logging ahead of the registration")
    _preparing = threading.Thread(target=prepare, name="prepare-model-logging", daemon=True)
    _preparing.start()


def rehearse_model_logging() -> None:
    """Log a one-layer model as `log_pytorch_model` does, to a temporary directory instead of the run,
    and resolve the tags MLflow gives a logged model: what is done once per process is then done. That
    is torch.export's compiler stack (2-3 s of imports on a small machine), MLflow's model flavors,
    its check of the pip requirements against the installed packages (it maps every installed
    package's modules: 0.6 s), and its context tags (git's commit through GitPython, whether this is
    a notebook through IPython)."""
    import mlflow.pytorch
    from mlflow.tracking.context.registry import resolve_tags

    example = np.zeros((2, 1), dtype=np.float32)  # 2 rows, as the registration's: a batch of 1 would specialize
    with tempfile.TemporaryDirectory() as directory:
        mlflow.pytorch.save_model(torch.nn.Linear(1, 1), f"{directory}/model", **_model_files(example, example))
    resolve_tags()


def yield_the_cpu() -> None:
    """Run the calling thread under SCHED_IDLE (Linux, where a policy is per thread; elsewhere
    nothing changes): it runs only where a core would idle, and gives way at once to a thread that
    wakes, such as a training worker back from its all-reduce. Where Linux groups processes by session
    (autogroup, on in most distributions), it yields only within the driver's: to the Ray the driver
    started, not to a `ray start` cluster's workers on the same cores."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))


def log_pytorch_model(model: torch.nn.Module, input_example: np.ndarray, *, name: str) -> Any:
    """The default: an MLflow PyTorch model (an exported program) with a signature and input example."""
    import mlflow.pytorch

    if _preparing is not None:  # torch.export keeps global state while it traces: one export at a time
        _preparing.join()
    with torch.no_grad():
        output = model(torch.from_numpy(input_example)).numpy()
    return mlflow.pytorch.log_model(model, name=name, **_model_files(input_example, output))


def _model_files(input_example: np.ndarray, output: np.ndarray) -> dict[str, Any]:
    """What a logged PyTorch model is saved with beside its weights: signature, input example, requirements."""
    from mlflow.models import infer_signature

    return {
        "signature": infer_signature(input_example, output),
        "input_example": input_example,
        "pip_requirements": [f"torch=={torch.__version__.split('+')[0]}"],
    }


def log_texts(config: Config, run_id: str, texts: dict[str, str]) -> None:
    """The recipe's artifacts (a generated sample, say), as text files of the run."""
    client = _client(config.mlflow.tracking_uri)
    for file_name, text in texts.items():
        client.log_text(run_id, text, file_name)


@contextlib.contextmanager
def _active_run(tracking_uri: str, run_id: str) -> Iterator[None]:
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
