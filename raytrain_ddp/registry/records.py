"""What the service writes into MLflow besides metrics: the names of its tags, a checkpoint's score and
a registered version, as every module of the registry reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
# On a run of streams that left unreadable files out (data.max_bad_files): how many, and their names.
SKIPPED_FILES_TAG = "raytrain_ddp.skipped_files"
SKIPPED_FILES = "skipped_files.txt"
# On each registered version of a classifier, and beside its model: data.class_names, output by output.
CLASS_NAMES_TAG = "raytrain_ddp.class_names"
CLASS_NAMES = "class_names.json"


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
