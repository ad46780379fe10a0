"""The registered model: a version logged and registered with the run's tags and score, the registry
read, the `champion` alias converged to champion.py's rule (`promote`: by hand)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from raytrain_ddp.config.schema import Config
from raytrain_ddp.registry import champion
from raytrain_ddp.registry.endpoint import mlflow_client, sqlite_file
from raytrain_ddp.registry.records import (
    CHAMPION,
    CHAMPION_TAG,
    CHECKPOINT_TAG,
    MODEL_ARTIFACT,
    PROMOTED_TAG,
    RUN_NAME_TAG,
    SCORE_ATTRIBUTE_TAG,
    SCORE_ORDER_TAG,
    SCORE_TAG,
    RegisteredModel,
    Score,
)
from raytrain_ddp.registry.tracking import active_run

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)


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

    client = mlflow_client(config.mlflow.tracking_uri)
    name = config.mlflow.model_name
    # Inside: registering a `models:/m-...` source resolves it through MLflow's global tracking URI.
    with active_run(config.mlflow.tracking_uri, run_id):
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
    if (database := sqlite_file(tracking_uri)) is not None and not database.is_file():
        raise LookupError(f"no registered model '{name}' in {tracking_uri}: that store does not exist")
    from mlflow.exceptions import MlflowException

    client = mlflow_client(tracking_uri)
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
    for version in mlflow_client(config.mlflow.tracking_uri).search_model_versions(
        f"name = '{name}' and run_id = '{run_id}'"
    ):
        if version.tags.get(CHECKPOINT_TAG) == checkpoint_path:
            return _registered(version)
    return None


def latest_version(config: Config) -> RegisteredModel | None:
    """The newest version of `mlflow.model_name` (the highest number), with its score; None if the
    model has no version (or does not exist)."""
    name = config.mlflow.model_name
    found = mlflow_client(config.mlflow.tracking_uri).search_model_versions(
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
