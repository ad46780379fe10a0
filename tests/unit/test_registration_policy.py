"""mlflow.register=if_better against a real MLflow sqlite registry (no Ray): what it compares, and
what it registers when the latest version cannot be compared."""

from __future__ import annotations

from pathlib import Path

from raytrain_ddp import load_config
from raytrain_ddp.driver.registration import is_better
from raytrain_ddp.registry import records

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


def test_if_better_compares_only_a_score_on_the_same_metric_and_order(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_config(TINY, overrides=[f"mlflow.tracking_uri={uri}", "mlflow.model_name=m"])
    client = MlflowClient(uri)
    mine = records.Score("val_mse", "min", 0.25)

    def add_version(**tags: str) -> None:
        client.create_model_version("m", source=str(tmp_path), tags=tags)

    assert is_better(config, mine) == (True, "")  # no model yet: its first version
    client.create_registered_model("m")
    add_version()  # registered by hand, or before versions carried their score
    assert is_better(config, mine) == (
        True,
        "registered: version 1 has no score, not comparable with val_mse (min); "
        "mlflow.register=if_better registers what it cannot compare",
    )
    score = {records.SCORE_ATTRIBUTE_TAG: "val_accuracy", records.SCORE_ORDER_TAG: "max", records.SCORE_TAG: "0.9"}
    add_version(**score)
    assert (
        is_better(config, mine)[0]
        and "version 2 has val_accuracy (max) 0.9, not comparable" in is_better(config, mine)[1]
    )
    add_version(
        **{
            **score,
            records.SCORE_ATTRIBUTE_TAG: "val_mse",
            records.SCORE_ORDER_TAG: "min",
            records.SCORE_TAG: "0.25",
        }
    )
    assert is_better(config, mine) == (
        False,
        "not registered: val_mse 0.25 is not better than version 3's 0.25 (mlflow.register=if_better)",
    )  # an equal score adds nothing
    assert is_better(config, records.Score("val_mse", "min", 0.2)) == (
        True,
        "val_mse 0.2 is better than version 3's 0.25",
    )
