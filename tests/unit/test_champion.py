"""The registry's champion and each version's lineage, without Ray: the rule `champion.champion`
walks, case by case, with the line each version gets; and a version registered through
`model_registry.register_model` into a real MLflow sqlite store, with its lineage tags and the aliases."""

from __future__ import annotations

import hashlib
import math
import shutil
import subprocess
from functools import partial
from pathlib import Path

import numpy as np
import torch
from mlflow.tracking import MlflowClient
from torch.utils.data import TensorDataset

from raytrain_ddp import load_config
from raytrain_ddp.data import datasets as data
from raytrain_ddp.driver.registration import lineage, service_version
from raytrain_ddp.registry import model_logging, model_registry, records, tracking
from raytrain_ddp.registry.champion import Promotion, champion, verdict
from raytrain_ddp.registry.records import RegisteredModel, Score

TINY = Path(__file__).parents[1] / "jobs" / "tiny.py"


def v(number: int, value: float | None = None, attribute: str = "val_accuracy", order: str = "max") -> RegisteredModel:
    score = None if value is None else Score(attribute, order, value)
    return RegisteredModel("m", number, f"models:/m/{number}", score)


def champion_of(*versions: RegisteredModel, promotion: Promotion | None = None) -> int | None:
    found = champion(list(versions), promotion)
    return None if found is None else found.version


def test_a_version_takes_the_champion_only_by_beating_it_on_the_same_metric():
    assert champion_of() is None
    assert champion_of(v(1, 0.9)) == 1  # the first version
    assert champion_of(v(1, 0.9), v(2, 0.8)) == 1  # worse
    assert champion_of(v(1, 0.9), v(2, 0.9)) == 1  # equal: strictly better only
    assert champion_of(v(1, 0.9), v(2, 0.95)) == 2
    assert champion_of(v(2, 0.95), v(1, 0.9)) == 2  # walked in version order, however listed
    assert champion_of(v(1, 0.9), v(2, 0.95), v(3, 0.92)) == 2  # a running best
    assert champion_of(v(1, 0.9), v(2, 0.1, "val_loss", "min")) == 1  # another metric
    assert champion_of(v(1, 0.9), v(2, 0.95, order="min")) == 1  # the same metric, ranked the other way
    assert champion_of(v(1, 0.2, "val_loss", "min"), v(2, 0.1, "val_loss", "min")) == 2  # min: less is better
    assert champion_of(v(1), v(2, 0.9)) == 1  # a first version without a score (registered by hand) stays
    assert champion_of(v(1, math.nan), v(2, 0.5)) == 2  # NaN never takes it, not even first
    assert champion_of(v(1, 0.5), v(2, math.nan)) == 1


def test_after_a_promotion_by_hand_later_versions_compete_with_the_promoted_one():
    best, promoted = v(2, 0.95), v(1, 0.9)
    by_hand = Promotion(version=1, newest=2)
    assert champion_of(promoted, best, promotion=by_hand) == 1
    # Version 3 beats the promoted version, not the older best: it takes over; version 4 does not beat it.
    assert champion_of(promoted, best, v(3, 0.92), v(4, 0.91), promotion=by_hand) == 3
    assert champion_of(promoted, best, v(3, 0.85), promotion=by_hand) == 1
    # Promoted over version 3: only versions after it compete.
    assert champion_of(promoted, best, v(3, 0.99), promotion=Promotion(1, newest=3)) == 1
    # A promotion of a version deleted since is no promotion.
    assert champion_of(best, v(3, 0.92), promotion=by_hand) == 2
    assert Promotion.from_tag(by_hand.tag()) == by_hand
    assert Promotion.from_tag("edited by hand") is None and Promotion.from_tag(None) is None


def test_each_version_is_told_how_it_fared_against_the_champion_before_it():
    versions = [v(1, 0.9), v(2, 0.8), v(3, 0.95), v(4, 0.1, "val_loss", "min"), v(5, math.nan)]
    said = [verdict(versions, None, version) for version in versions]
    assert said == [
        "champion: no version was champion before it",
        "not champion: val_accuracy 0.8 is not better than version 1's 0.9",
        "champion: val_accuracy 0.95 beats version 1's 0.9",
        "not champion: val_loss (min) 0.1 is not comparable with version 3's val_accuracy (max) 0.95; "
        "make it champion by hand: raytrain-ddp promote m 4",
        "not champion: val_accuracy nan is not better than version 3's 0.95",
    ]
    # After a promotion, against the promoted version.
    assert verdict([*versions, v(6, 0.85)], Promotion(2, newest=5), v(6, 0.85)) == (
        "champion: val_accuracy 0.85 beats version 2's 0.8"
    )


def test_a_registered_version_carries_its_lineage_and_moves_the_aliases(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for file in (TINY, TINY.with_suffix(".yaml")):
        shutil.copy(file, repo)
    git = partial(subprocess.run, cwd=repo, check=True, capture_output=True, text=True)
    git(["git", "init", "-q"])
    git(["git", "add", "."])
    git(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "tiny"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [f"mlflow.tracking_uri={uri}", "mlflow.model_name=m", "mlflow.experiment=e", "run.name=r"]
    config = load_config(str(repo / "tiny.py"), overrides=overrides)
    run_id = tracking.start_run(config, str(tmp_path / "runs" / "r"))
    rows = TensorDataset(torch.arange(40.0).reshape(10, 4), torch.zeros(10))
    fingerprint = data.fingerprint(rows, len(rows))
    made_of = lineage(config, run_id, fingerprint)
    log = partial(model_logging.log_pytorch_model, torch.nn.Linear(4, 1), np.zeros((2, 4), np.float32))

    model = model_registry.register_model(config, run_id, "ckpt-1", Score("val_mse", "min", 0.25), log, made_of)

    client = MlflowClient(uri)
    tags = client.get_model_version("m", "1").tags
    head = git(["git", "rev-parse", "HEAD"]).stdout.strip()
    assert {key: tags[key] for key in made_of} == {
        "raytrain_ddp.run_id": run_id,
        "raytrain_ddp.code_sha256": hashlib.sha256((repo / "tiny.py").read_bytes()).hexdigest(),
        "raytrain_ddp.code_git_commit": head,
        "raytrain_ddp.code_git_dirty": "false",
        "raytrain_ddp.data_fingerprint": fingerprint,
        "raytrain_ddp.torch_version": torch.__version__,
        "raytrain_ddp.ray_version": __import__("ray").__version__,
        "raytrain_ddp.raytrain_ddp_version": "0.1.0",
    }
    assert tags[records.CHECKPOINT_TAG] == "ckpt-1" and tags[records.CHAMPION_TAG] == model.champion
    assert fingerprint.endswith("(10 rows, the first 8)")
    assert data.fingerprint(TensorDataset(torch.arange(40.0).reshape(10, 4) + 1, torch.zeros(10)), 10) != fingerprint
    assert model.champion == "champion: no version was champion before it"
    assert int(client.get_model_version_by_alias("m", "champion").version) == 1

    worse = model_registry.register_model(config, run_id, "ckpt-2", Score("val_mse", "min", 0.5), log, made_of)
    assert worse.version == 2 and worse.champion == "not champion: val_mse 0.5 is not better than version 1's 0.25"
    assert int(client.get_model_version_by_alias("m", "champion").version) == 1
    assert int(client.get_model_version_by_alias("m", "latest").version) == 2  # MLflow's own: the newest

    # The recipe changed since the commit: dirty, and another hash. Outside a work tree: the hash alone.
    (repo / "tiny.py").write_text((repo / "tiny.py").read_text() + "\n# changed\n")
    changed = lineage(config, run_id, fingerprint)
    assert changed["raytrain_ddp.code_git_dirty"] == "true"
    assert changed["raytrain_ddp.code_sha256"] != made_of["raytrain_ddp.code_sha256"]
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in (TINY, TINY.with_suffix(".yaml")):
        shutil.copy(file, plain)
    outside = lineage(load_config(str(plain / "tiny.py"), overrides=overrides), run_id, fingerprint)
    assert "raytrain_ddp.code_git_commit" not in outside and "raytrain_ddp.code_git_dirty" not in outside
    assert outside["raytrain_ddp.code_sha256"] == made_of["raytrain_ddp.code_sha256"]


def test_a_service_never_installed_still_tags_its_versions(monkeypatch):
    """Run from a checkout on PYTHONPATH (as on a GPU machine with no pip install) there is no package
    metadata: the tag says so, and where the code came from, instead of failing the registration."""
    import importlib.metadata

    assert service_version() == "0.1.0"

    def no_such_package(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_such_package)
    assert service_version() == f"not installed: imported from {Path(tracking.__file__).parents[1]}"
