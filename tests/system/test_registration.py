"""Registration you control: `mlflow.register` (always | if_better | never), and one rule for which
checkpoint is best, shared by the console's ★, registration and the summary. Real 2-worker runs of
the tiny recipe, one MLflow sqlite store for the module; the runs are shared by the checks.

Model `tiny` (ranked by val_mse, min):
  learns         lr 0.05, 2 epochs: the model's first version (if_better)
  stuck          lr 1e-30 (weights never move): every epoch ties; worse than version 1: not registered
  learns, again  resumed to 4 epochs: its best improved, so a new version
Model `tiny-pinned` (ranked by epoch, min: epoch 1 stays best however long the run trains):
  pinned         1 epoch, never: nothing registered; then `register()` registers it anyway
  pinned, again  resumed to 2 epochs (if_better): its best is the version registered, no new one
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from raytrain_ddp import load_config
from raytrain_ddp.registry.records import CHECKPOINT_TAG, SCORE_ATTRIBUTE_TAG, SCORE_ORDER_TAG, SCORE_TAG

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")
FLOPS_PER_ROW = 2 * (4 * 16 + 16) * 2 + 2 * 16  # tiny.py's count_flops


def _run(workspace, *overrides: str):
    """A run of the tiny recipe and what its console printed."""
    from raytrain_ddp import run

    out = io.StringIO()
    summary = run(load_config(TINY, overrides=workspace.overrides(*overrides)), console=Console(file=out, width=1000))
    return summary, out.getvalue()


def _versions(workspace, model: str) -> list:
    from mlflow.tracking import MlflowClient

    found = MlflowClient(workspace.tracking_uri).search_model_versions(f"name = '{model}'")
    return sorted(found, key=lambda v: int(v.version))


@pytest.fixture(scope="module")
def tiny(ray_session, module_workspace):
    """The three runs of model `tiny`, in order, each with the versions the registry held after it."""
    learns = ("train.lr=0.05", "run.name=learns")
    runs = {}
    for name, overrides in (
        ("learns", (*learns, "train.epochs=2")),
        ("stuck", ("train.lr=1e-30", "train.epochs=3", "run.name=stuck")),
        ("learns again", (*learns, "train.epochs=4")),
    ):
        summary, out = _run(module_workspace, *overrides)
        runs[name] = summary, out, _versions(module_workspace, "tiny")
    return runs


def test_if_better_registers_a_models_first_run_with_its_score(tiny):
    from mlflow.tracking import MlflowClient

    summary, out, versions = tiny["learns"]
    [version] = versions
    assert summary.model.version == 1 and summary.registration == ""
    assert version.tags[CHECKPOINT_TAG] == summary.best_checkpoint
    assert version.tags[SCORE_ATTRIBUTE_TAG] == "val_mse" and version.tags[SCORE_ORDER_TAG] == "min"
    assert float(version.tags[SCORE_TAG]) == summary.metrics["val_mse"]
    assert re.search(r"^  registered model +tiny  version 1$", out, re.M)
    assert re.search(r"^  registry alias +champion: no version was champion before it$", out, re.M)
    # tiny gives its FLOPs (count_flops): the MLflow run has them, every report the model FLOP/s of
    # both workers at the pace of the slower; no MFU without a GPU's peak.
    run = MlflowClient(summary.tracking_uri).get_run(summary.mlflow_run_id)
    assert float(run.data.params["model_flops_per_sample"]) == FLOPS_PER_ROW
    final = summary.final_metrics
    assert final["model_flops_per_s"] == pytest.approx(FLOPS_PER_ROW * final["samples_per_s"])
    assert "mfu" not in final and "mfu_per_worker" not in final


def test_if_better_does_not_register_a_worse_run_and_says_why_and_how_to_register_it(tiny, module_workspace):
    from mlflow.tracking import MlflowClient

    learns, _, _ = tiny["learns"]
    stuck, out, versions = tiny["stuck"]
    assert len(versions) == 1 and stuck.model is None
    mine, theirs = stuck.metrics["val_mse"], learns.metrics["val_mse"]
    assert mine > theirs
    said = (
        f"not registered: val_mse {mine:.6g} is not better than version 1's {theirs:.6g} (mlflow.register=if_better); "
        f"register it anyway: raytrain-ddp register {stuck.run_path}"
    )
    assert stuck.registration == said
    assert re.search(rf"^  registered model +{re.escape(said)}$", out, re.M)
    assert "model URI" not in out
    assert MlflowClient(module_workspace.tracking_uri).get_run(stuck.mlflow_run_id).info.status == "FINISHED"


def test_equal_scores_the_star_the_best_checkpoint_and_what_ray_keeps_agree(tiny, module_workspace):
    """lr 1e-30 leaves every weight as it was: 3 epochs of one val_mse. Ray Train keeps (num_to_keep=2)
    and ranks best the later of equals; the ★ moves to each tie, and registration takes the last."""
    from raytrain_ddp.driver.registration import register

    stuck, out, _ = tiny["stuck"]
    run_dir = Path(stuck.run_path)
    lines = [line for line in out.splitlines() if re.match(r"epoch +\d/3 ", line)]
    assert len({re.search(r"val_mse (\S+)", line).group(1) for line in lines}) == 1  # a tie, as printed
    assert [i for i, line in enumerate(lines, 1) if "★ best" in line] == [1, 2, 3]
    assert sorted(p.name for p in run_dir.glob("epoch_*")) == ["epoch_0002", "epoch_0003"]  # Ray dropped the first
    assert Path(stuck.best_checkpoint) == run_dir / "epoch_0003"
    assert re.search(rf"best checkpoint +{re.escape(str(run_dir / 'epoch_0003'))}  \(epoch 3,", out)

    # Registered anyway, whatever mlflow.register said: the checkpoint the ★ marked last.
    model = register(stuck.run_path, console=Console(file=io.StringIO()))
    versions = _versions(module_workspace, "tiny")
    assert model.version == int(versions[-1].version) == 3  # after `learns again`'s version 2
    assert versions[-1].tags[CHECKPOINT_TAG] == str(run_dir / "epoch_0003")


def test_if_better_registers_a_resumed_run_whose_best_improved(tiny):
    learns, _, _ = tiny["learns"]
    again, out, versions = tiny["learns again"]
    assert [int(v.version) for v in versions] == [1, 2]
    assert again.resumed.checkpoint == "epoch_0002" and again.mlflow_run_id == learns.mlflow_run_id
    mine, theirs = again.metrics["val_mse"], learns.metrics["val_mse"]
    assert again.model.version == 2 and Path(again.best_checkpoint).name in ("epoch_0003", "epoch_0004")
    assert again.registration == f"val_mse {mine:.6g} is better than version 1's {theirs:.6g}"
    assert re.search(r"^  registered model +tiny  version 2  \(val_mse [\d.]+ is better than version 1's", out, re.M)


def test_never_registers_nothing_and_a_resume_whose_best_is_registered_adds_no_version(ray_session, workspace):
    from mlflow.tracking import MlflowClient

    from raytrain_ddp.driver.registration import register

    pinned = ("checkpoint.score_attribute=epoch", "checkpoint.score_order=min", "mlflow.model_name=tiny-pinned")
    never, out = _run(workspace, *pinned, "train.epochs=1", "mlflow.register=never", "run.name=pinned")
    client = MlflowClient(workspace.tracking_uri)
    assert never.model is None and client.search_registered_models() == []
    assert client.get_run(never.mlflow_run_id).info.status == "FINISHED"
    assert never.registration == (
        f"not registered (mlflow.register=never); register it: raytrain-ddp register {never.run_path}"
    )
    assert Path(never.best_checkpoint).name == "epoch_0001"
    # Run again, finished: answered from the run's record and the registry, nothing trained or started.
    finished, out = _run(workspace, *pinned, "train.epochs=1", "mlflow.register=never", "run.name=pinned")
    assert finished.already_finished and finished.attempts == 0 and finished.registration == never.registration
    assert "has already finished training (1 epoch) and its model is not registered" in out

    registered = register(never.run_path, console=Console(file=io.StringIO()))
    assert registered.version == 1

    again, out = _run(workspace, *pinned, "train.epochs=2", "run.name=pinned")
    assert again.resumed.checkpoint == "epoch_0001"
    assert [int(v.version) for v in _versions(workspace, "tiny-pinned")] == [1]
    assert again.model.version == 1 and Path(again.best_checkpoint).name == "epoch_0001"
    assert "already registered" in again.registration
    assert re.search(r"^  registered model +tiny-pinned  version 1  \(already registered", out, re.M)
    # The resumed driver knows the run's best so far: epoch 2 is no ★, as epoch 1 stays the best.
    [epoch_2] = [line for line in out.splitlines() if re.match(r"epoch +2/2 ", line)]
    assert "★" not in epoch_2


def test_early_stopping_ends_the_run_finished_registers_its_best_and_its_counter_survives_a_resume(
    ray_session, workspace
):
    """Ranked by epoch (min), epoch 1 stays best: with patience 2 of 10 epochs the run stops after
    epoch 3, finished, and registers epoch 1. Run again, it is done (no Ray); resumed with patience 3
    it trains one epoch more, counting on from the checkpoint's 2 (from 0 it would train 3 more)."""
    from mlflow.tracking import MlflowClient

    from raytrain_ddp.registry.records import STOPPED_EARLY_TAG

    early = (
        "checkpoint.score_attribute=epoch",
        "checkpoint.score_order=min",
        "mlflow.model_name=tiny-early",
        "train.epochs=10",
        "run.name=early",
    )
    stopped, out = _run(workspace, *early, "train.early_stopping.patience=2")
    assert stopped.epochs == 3 and stopped.attempts == 1
    why = "epoch has not improved on its best, 1, for 2 evaluations (train.early_stopping.patience=2)"
    assert stopped.stopped_early == why
    assert f"stopping early: {why}" in out and "early finished (stopped early): 3 epochs in" in out
    assert re.search(r"^  stopped early +epoch has not improved", out, re.M)
    assert "train.early_stopping.patience=null  (or a larger patience)" in out
    assert Path(stopped.best_checkpoint).name == "epoch_0001" and stopped.model.version == 1
    [version] = _versions(workspace, "tiny-early")
    saved = json.loads((Path(stopped.best_checkpoint) / "config.json").read_text())  # what trained it
    digest = hashlib.sha256(json.dumps(saved, sort_keys=True).encode()).hexdigest()
    assert version.tags["raytrain_ddp.config_sha256"] == digest
    client = MlflowClient(workspace.tracking_uri)
    run = client.get_run(stopped.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags[STOPPED_EARLY_TAG] == why
    history = client.get_metric_history(stopped.mlflow_run_id, "evals_since_best")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [0, 1, 2]

    done, out = _run(workspace, *early, "train.early_stopping.patience=2")
    assert done.already_finished and done.attempts == 0 and done.stopped_early == why
    assert "has already finished training (3 epochs)" in out

    longer, out = _run(workspace, *early, "train.early_stopping.patience=3")
    assert longer.resumed.checkpoint == "epoch_0003" and longer.epochs == 4
    assert "for 3 evaluations (train.early_stopping.patience=3)" in longer.stopped_early
    assert longer.model.version == 1 and "already registered" in longer.registration
